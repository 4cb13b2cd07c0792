"""vLLM workers behind kvrelay's faces: a mixed cluster (native and vLLM workers, one router),
``kvrelay router --vllm-engine`` (the router drives the engines from its own process), and
``kvrelay cluster --workers 2 --engine vllm``, which starts its own vLLM servers, streaming to the official
``openai`` client."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import openai
import pytest

from kvrelay.launch.child import ChildProcess
from kvrelay.launch.vllm_server import VllmServer, attached_router_flags
from tests.support.processes import Router, child_env, kvrelay, start_worker, stop_all, wait_until
from tests.support.vllm_cluster import (
    direct_completion,
    engine_counts,
    openai_stream,
    routed_completion,
    settle,
    vllm_worker,
)

BLOCK = 64


def test_a_mixed_cluster_serves_through_both_runtimes(
    vllm_engines: list[VllmServer], vllm_model: Path, tmp_path: Path
) -> None:
    router = Router(tmp_path, vllm_model, "--policy", "round_robin")
    native = start_worker(tmp_path, "n0", router.workers_url, vllm_model)
    engine = vllm_engines[1]
    vllm = vllm_worker(tmp_path, "v1", router.workers_url, engine)
    try:
        for worker in (native, vllm):
            worker.wait_for(r"kvrelay worker ready", 120)
        wait_until(lambda: sorted(router.live_workers()) == ["n0", "v1"] or None, 30, "both workers live")
        models = {w["models"][0] for w in router.live_workers().values()}
        assert models == {vllm_model.name}  # one model name, two kinds of KV
        before = engine_counts(engine)["done"]
        prompt = [9 + (i * 3) % 250 for i in range(200)]
        for k in range(4):
            answer = routed_completion(router.http_url, vllm_model.name, [*prompt, k], 6)
            assert answer["finish"] == "length" and answer["usage"]["completion_tokens"] == 6, answer
        assert engine_counts(engine)["done"] - before == 2  # round robin: two through vLLM, two natively
        assert router.cluster()["router_counters"].get("declines", 0) == 0
    finally:
        stop_all([native, vllm, router.child])


def test_a_router_drives_vllm_engines_from_its_own_process(
    vllm_engines: list[VllmServer], vllm_model: Path, tmp_path: Path
) -> None:
    """No worker process: the router's in-process workers v1 and v2 learn residency from the engines' KV events,
    so a prefix warmed on the second engine behind the router's back draws the requests there, and the official
    client streams them with the cached tokens the engine reports."""
    router = Router(tmp_path, vllm_model, *attached_router_flags([e.spec for e in vllm_engines]))
    try:
        wait_until(lambda: sorted(router.live_workers()) == ["v1", "v2"] or None, 30, "both attached workers live")
        prefix = [19 + (i * 7) % 280 for i in range(6 * BLOCK)]
        direct_completion(vllm_engines[1], [*prefix, 3], 1)
        settle(router, "v2")
        before = [engine_counts(e)["done"] for e in vllm_engines]
        for k in range(2):
            wait_until(lambda: not router.cluster()["requests"] or None, 30, "no request in flight")
            usage = openai_stream(router.http_url, vllm_model.name, [*prefix, 40 + k], 5)[-1].usage
            assert usage is not None and usage.completion_tokens == 5, usage
            assert usage.prompt_tokens_details is not None
            assert (usage.prompt_tokens_details.cached_tokens or 0) >= 5 * BLOCK, usage
        after = [engine_counts(e)["done"] for e in vllm_engines]
        assert (after[0] - before[0], after[1] - before[1]) == (0, 2), (before, after)
        assert router.cluster()["router_counters"].get("declines", 0) == 0
    finally:
        stop_all([router.child])


@pytest.mark.timeout(900)
def test_cluster_with_vllm_engines_serves_the_openai_api(vllm_model: Path, tmp_path: Path) -> None:
    args = ["--workers", "2", "--engine", "vllm", "--model", str(vllm_model), "--dtype", "float32", "--port", "0"]
    args += ["--kv-tokens", "4096", "--lanes", "4", "--db", f"sqlite:///{tmp_path / 'facts.sqlite3'}"]
    cluster = kvrelay("cluster", "cluster", args, child_env(tmp_path))
    try:
        # The router drives both engines from its own process: workers v1 and v2, no worker process.
        http_url = cluster.wait_for(r"kvrelay cluster ready http=(\S+) workers=v1,v2$", 600).group(1)
        engines = [m.group(1) for m in (cluster.wait_for(rf"v{i}'s vLLM engine: (\S+),", 5) for i in (1, 2))]
        assert not [line for line in cluster.lines if "kvrelay worker ready" in line]
        _serves_text_and_stops(cluster, http_url, vllm_model.name)
        for url in engines:  # the supervisor stopped its engines
            with pytest.raises(httpx.HTTPError):
                httpx.get(url + "/health", timeout=2)
    finally:
        cluster.stop()


@pytest.mark.timeout(600)
def test_cluster_with_in_process_vllm_engines_serves_the_openai_api(vllm_model: Path, tmp_path: Path) -> None:
    """``--engine vllm-in-process``: no vLLM server starts; the router child, run by vLLM's interpreter, builds
    both engines in its own process (workers v1 and v2, their engine cores its children) and the official
    client streams from it; SIGTERM stops the router and its engines with it."""
    args = ["--workers", "2", "--engine", "vllm-in-process", "--model", str(vllm_model), "--dtype", "float32"]
    args += ["--port", "0", "--kv-tokens", "4096", "--lanes", "4", "--db", f"sqlite:///{tmp_path / 'facts.sqlite3'}"]
    cluster = kvrelay("cluster", "cluster", args, child_env(tmp_path))
    try:
        http_url = cluster.wait_for(r"kvrelay cluster ready http=(\S+) workers=v1,v2$", 300).group(1)
        assert not [line for line in cluster.lines if "vLLM engine: http" in line]  # no server was started
        assert len([line for line in cluster.lines if "engine in-process://" in line]) == 2
        _serves_text_and_stops(cluster, http_url, vllm_model.name)
        with pytest.raises(httpx.HTTPError):
            httpx.get(http_url + "/health", timeout=2)
    finally:
        cluster.stop()


def _serves_text_and_stops(cluster: ChildProcess, http_url: str, model: str) -> None:
    """The official client lists the one model and streams 12 tokens with text from the cluster; SIGTERM then
    ends it with 0."""
    client = openai.OpenAI(base_url=http_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == [model]
    chunks = openai_stream(http_url, model, "the quick brown fox jumps over the lazy dog " * 8, 12)
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) >= 1
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    cluster.signal(signal.SIGTERM)
    assert cluster.process.wait(120) == 0
