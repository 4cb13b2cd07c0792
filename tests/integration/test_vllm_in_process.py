"""vLLM engines in the router's own process (``kvrelay router --vllm-in-process``, run by vLLM's interpreter): the
official ``openai`` client streams through them, the router routes by the residency their KV events publish,
a client that goes away aborts the engine's request, and ``kill -9`` of one engine core mid-stream loses no
token."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvrelay.launch.vllm_server import vllm_python
from kvrelay.testing.tiny_models import make_tiny_model
from kvrelay.testing.vllm import TINY_CONTEXT, TINY_KV_BYTES_PER_TOKEN, TINY_LANES, VLLM_BLOCK_TOKENS
from tests.support.processes import Router, stop_all, stream_completion, wait_until
from tests.support.vllm_cluster import openai_stream

BLOCK = VLLM_BLOCK_TOKENS
BLOCKS = 64


@pytest.fixture(scope="module")
def router(vllm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    """A router with two in-process engines of ``vllm_model`` (``BLOCKS`` blocks each), both live."""
    flags = ["--vllm-in-process", "2", "--vllm-dtype", "float32", "--vllm-lanes", str(TINY_LANES)]
    flags += ["--vllm-kv-cache-bytes", str(BLOCKS * BLOCK * TINY_KV_BYTES_PER_TOKEN)]
    flags += ["--vllm-max-model-len", str(TINY_CONTEXT)]
    home = tmp_path_factory.mktemp("in-process")
    started = Router(home, vllm_model, *flags, python=vllm_python(), ready_s=300)
    try:
        wait_until(lambda: sorted(started.live_workers()) == ["v1", "v2"] or None, 30, "both engines' workers live")
        yield started
    finally:
        stop_all([started.child])


def _idle(router: Router) -> None:
    wait_until(lambda: not router.cluster()["requests"] or None, 30, "no request in flight")


def _engine_cores(router: Router) -> list[int]:
    """The router's children that are vLLM engine cores, by pid."""
    found = []
    for task in Path(f"/proc/{router.child.process.pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"VLLM::EngineCore"):
                found.append(int(pid))
    return sorted(found)


def test_the_openai_client_streams_through_in_process_engines_routed_by_their_kv_events(
    router: Router, vllm_model: Path
) -> None:
    """The first request computes a 6-block prefix on one engine; its KV events tell the router, which sends the
    next two to that engine, where vLLM serves at least 5 blocks of each from its prefix cache."""
    _idle(router)
    captured = router.cluster()["router_counters"].get("reuse_captured_tokens", 0)
    prefix = [11 + (i * 13) % 300 for i in range(6 * BLOCK)]
    usages = []
    for k in range(3):
        _idle(router)
        if k == 1:
            for worker in ("v1", "v2"):  # the first request's KV events have reached the router
                seq = router.live_workers()[worker]["seq"]
                wait_until(lambda w=worker, s=seq: router.live_workers()[w]["seq"] >= s + 2 or None, 30, "beats")
        chunks = openai_stream(router.http_url, vllm_model.name, [*prefix, 40 + k], 5)
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens == 5, usage
        assert sum(len(c.choices[0].text) for c in chunks if c.choices) > 0
        usages.append(usage)
    for usage in usages[1:]:
        assert usage.prompt_tokens_details is not None
        assert (usage.prompt_tokens_details.cached_tokens or 0) >= 5 * BLOCK, usage
    counters = router.cluster()["router_counters"]
    assert counters.get("reuse_captured_tokens", 0) - captured >= 2 * 5 * BLOCK, counters
    assert counters.get("declines", 0) == 0, counters


def _timed_stream(router: Router, model: str, prompt: list[int], max_tokens: int, stop_after: int) -> list[float]:
    """The arrival times of a greedy stream's chunks with text, up to ``stop_after`` of them (the stream is
    closed then)."""
    times: list[float] = []
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    with httpx.stream("POST", router.http_url + "/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                times.append(time.monotonic())
                if len(times) == stop_after:
                    break
    return times


def test_a_client_that_goes_away_aborts_the_engines_request(router: Router, vllm_model: Path) -> None:
    """A stream of 1,900 tokens closed at its first token: the engine stops running it. Its own running count
    (which its next step reports: a one-token request on the same prompt makes it step) reaches the router's
    view at 0 well before the 1,900 tokens could have been generated at the rate measured just before."""
    _idle(router)
    prompt = [17 + (i * 5) % 290 for i in range(2 * BLOCK)]
    paced = _timed_stream(router, vllm_model.name, [*prompt, 3], 300, 300)
    per_token = (paced[-1] - paced[0]) / 299  # the first chunk may carry several tokens: a shorter estimate
    _idle(router)
    started = _timed_stream(router, vllm_model.name, prompt, 1900, 1)[0]
    _idle(router)
    chunks = list(stream_completion(router.http_url, vllm_model.name, [*prompt, 7], 1))
    assert chunks[-1]["usage"]["completion_tokens"] == 1
    workers = router.live_workers
    wait_until(lambda: all(w["active_lanes"] == 0 for w in workers().values()) or None, 30, "the engines idle")
    assert time.monotonic() - started < 0.8 * 1900 * per_token, (time.monotonic() - started, per_token)


@pytest.mark.timeout(600)
def test_killing_an_engine_core_mid_stream_loses_no_token(router: Router, vllm_model: Path) -> None:
    """Two greedy streams of 1,500 tokens on a common prefix; ``kill -9`` of the engine core running them (the
    worker of one of them) at their first tokens: both complete with every token, continued on the other engine;
    the killed engine is built again and its worker serves again."""
    _idle(router)
    cores = _engine_cores(router)
    assert len(cores) == 2, cores
    budget = 1500
    lead = [29 + (i * 7) % 270 for i in range(4 * BLOCK)]
    results: dict[int, dict[str, Any]] = {}
    streaming = [threading.Event() for _ in range(2)]

    def consume(i: int) -> None:
        chunks = []
        for chunk in stream_completion(router.http_url, vllm_model.name, [*lead, 100 + i], budget):
            chunks.append(chunk)
            streaming[i].set()
        choices = [c for c in chunks if c.get("choices")]
        results[i] = {"usage": chunks[-1].get("usage"), "finish": choices[-1]["choices"][0]["finish_reason"]}

    threads = [threading.Thread(target=consume, args=(i,), daemon=True) for i in range(2)]
    for thread in threads:
        thread.start()
    wait_until(lambda: all(e.is_set() for e in streaming) or None, 120, "both streams running", every_s=0.01)
    running = {r["worker_id"] for r in router.cluster()["requests"].values()}
    retries = router.cluster()["router_counters"].get("retries", 0)
    victim = sorted(running)[0]
    os.kill(cores[int(victim[1:]) - 1], signal.SIGKILL)  # v1's engine started first
    for thread in threads:
        thread.join(300)
    assert sorted(results) == [0, 1], results
    for result in results.values():
        assert result["usage"]["completion_tokens"] == budget, result
        assert result["finish"] == "length", result
    counters = router.cluster()["router_counters"]
    assert counters.get("retries", 0) > retries, counters  # the kill cut them, and the router continued them
    # The engine is built again in the router's process: its worker comes back in a newer epoch with free pages,
    # and takes requests again.
    epoch = router.live_workers()[victim]["epoch"]
    wait_until(
        lambda: (w := router.live_workers()[victim])["epoch"] > epoch and w["pages_free"] > 0 or None,
        180,
        f"{victim}'s engine built again",
    )
    assert len(_engine_cores(router)) == 2
    wait_until(lambda: _steady_epoch(router, victim) or None, 60, f"{victim} in one epoch for three heartbeats")
    before = _accepted_by(router, victim)
    done: list[int] = []

    def cold(k: int) -> None:
        prompt = [7 + (k * 31 + i * 17) % 300 for i in range(BLOCK)]
        last = list(stream_completion(router.http_url, vllm_model.name, prompt, 200))[-1]
        done.append(last["usage"]["completion_tokens"])

    senders = [threading.Thread(target=cold, args=(k,), daemon=True) for k in range(6)]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join(120)
    assert done == [200] * 6, done
    wait_until(lambda: _accepted_by(router, victim) > before or None, 30, f"{victim} taking requests again")


def _steady_epoch(router: Router, worker_id: str) -> bool:
    """Whether ``worker_id`` kept its epoch over its next three heartbeats (a rebuilt engine's worker moves to a
    new epoch twice: its KV events reconnect, then its engine is back)."""
    first = router.live_workers()[worker_id]
    wait_until(lambda: router.live_workers()[worker_id]["seq"] >= first["seq"] + 3 or None, 30, "heartbeats")
    return bool(router.live_workers()[worker_id]["epoch"] == first["epoch"])


def _accepted_by(router: Router, worker_id: str) -> int:
    """Offers ``worker_id`` accepted, from the router's fact store."""
    import sqlite3

    with sqlite3.connect(f"file:{router.home / 'facts.sqlite3'}?mode=ro", uri=True) as db:
        query = "SELECT COUNT(*) FROM decisions WHERE chosen_worker = ? AND outcome = 'accepted'"
        return int(db.execute(query, (worker_id,)).fetchone()[0])


def test_in_process_engines_without_vllm_in_the_interpreter_fail_with_the_fix(vllm_model: Path, tmp_path: Path) -> None:
    """This suite's interpreter has no vLLM: the router says what is missing and how to run it, and exits 2."""
    from tests.support.processes import child_env, kvrelay

    args = ["--port", "0", "--worker-port", "0", "--model", str(vllm_model), "--vllm-in-process", "1"]
    child = kvrelay("router", "router", args, child_env(tmp_path))
    try:
        line = child.wait_for(r"needs vLLM in this interpreter", 120).string
        assert ".venv-vllm/bin/kvrelay router" in line, line
        assert child.process.wait(60) == 2
    finally:
        child.stop()


def test_a_killed_router_takes_its_engine_cores_with_it(vllm_model: Path, tmp_path: Path) -> None:
    """``kill -9`` of a router with an in-process engine: its engine core (which vLLM leaves running when its
    parent dies) is killed by the router's reaper, so nothing spins on and the KV event port is free again."""
    flags = ["--vllm-in-process", "1", "--vllm-dtype", "float32", "--vllm-lanes", str(TINY_LANES)]
    flags += ["--vllm-kv-cache-bytes", str(32 * BLOCK * TINY_KV_BYTES_PER_TOKEN), "--vllm-max-model-len", "1024"]
    router = Router(tmp_path, vllm_model, *flags, python=vllm_python(), ready_s=300)
    try:
        cores = _engine_cores(router)
        assert len(cores) == 1, cores
        router.child.process.kill()
        router.child.process.wait(30)
        wait_until(lambda: not Path(f"/proc/{cores[0]}").exists() or None, 30, "the engine core gone")
    finally:
        stop_all([router.child])
        for pid in cores:
            if Path(f"/proc/{pid}").exists():
                os.kill(pid, signal.SIGKILL)


def test_a_sliding_window_models_engine_reuses_a_prefix_that_parts_inside_a_cached_prompt(
    tmp_path: Path,
) -> None:
    """A tiny Gemma 3 (sliding-window layers, window 128 tokens) in one in-process engine: a prompt sharing the
    first 3 blocks of a cached 4-block prompt and parting there gets those 3 blocks from the cache, as the router
    credits them. vLLM 0.32 keeps sliding-window KV only at a prompt's end and where prompts part unless told to
    keep a checkpoint at every block, and then recomputes all of them (0 cached)."""
    model = make_tiny_model(
        "gemma3",
        tmp_path / "tiny-gemma3",
        head_dim=32,
        sliding_window=128,
        max_position_embeddings=2048,
        eos_token_id=None,
    )
    kv_bytes_per_token = 6 * 2 * 2 * 32 * 4  # layers x (K, V) x KV heads x head size x float32 bytes
    flags = ["--vllm-in-process", "1", "--vllm-dtype", "float32", "--vllm-lanes", "4"]
    flags += ["--vllm-kv-cache-bytes", str(BLOCKS * BLOCK * kv_bytes_per_token), "--vllm-max-model-len", "2048"]
    router = Router(tmp_path / "home", model, *flags, python=vllm_python(), ready_s=300)
    try:
        wait_until(lambda: router.live_workers().get("v1") or None, 60, "the engine's worker live")
        first = [11 + (i * 13) % 300 for i in range(4 * BLOCK + 1)]
        parting = first[: 3 * BLOCK] + [7 + (i * 5) % 200 for i in range(2 * BLOCK)]
        cached = []
        for prompt in (first, parting):
            usage = openai_stream(router.http_url, model.name, prompt, 4)[-1].usage
            assert usage is not None and usage.prompt_tokens_details is not None, usage
            cached.append(usage.prompt_tokens_details.cached_tokens)
        assert cached == [0, 3 * BLOCK]
    finally:
        stop_all([router.child])
