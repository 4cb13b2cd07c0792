"""The official openai client against `kvrelay cluster --workers 2` (router and two worker processes), which
exports its request traces to an OTLP/HTTP collector in the test."""

from __future__ import annotations

import asyncio
import re
import secrets
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from kvrelay.models.loading.loader import load_artifacts
from kvrelay.testing.tiny_models import make_tiny_model
from tests.support.otlp_collector import Collector, ReceivedSpan, otlp_collector
from tests.support.processes import CLUSTER_READY, two_worker_cluster, wait_until
from tests.support.worker_harness import greedy_reference


@pytest.fixture(scope="module")
def collector() -> Iterator[Collector]:
    with otlp_collector() as c:
        yield c


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, collector: Collector) -> Iterator[tuple[str, Path]]:
    home = tmp_path_factory.mktemp("api-cluster")
    model = make_tiny_model("gemma3", home / "tiny-gemma3")
    process = two_worker_cluster(home, model, "--otlp-endpoint", collector.url)
    try:
        http_url = process.wait_for(CLUSTER_READY, 120).group(1)
        wait_until(lambda: httpx.get(http_url + "/health").status_code == 200 or None, 30, "a healthy router")
        yield http_url, model
        process.signal(signal.SIGTERM)
        assert process.process.wait(60) == 0
    finally:
        process.stop()


def test_sync_and_async_completions_and_chat_equal_the_runtime(cluster: tuple[str, Path]) -> None:
    http_url, model = cluster
    tokenizer = load_artifacts(model).tokenizer
    client = openai.OpenAI(base_url=http_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == [model.name]
    prompt = "a quick brown fox jumps over the lazy dog and runs far away " * 2
    expected = tokenizer.decode(greedy_reference(model, tokenizer.encode(prompt), 12), skip_special_tokens=True)
    whole = client.completions.create(model=model.name, prompt=prompt, max_tokens=12, temperature=0)
    assert whole.choices[0].text == expected and whole.usage.completion_tokens == 12
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model=model.name, prompt=prompt, max_tokens=12, temperature=0, stream=True)
        if c.choices
    )
    assert streamed == expected
    messages = [{"role": "user", "content": "tell me about the sea"}]
    chat = client.chat.completions.create(model=model.name, messages=messages, max_tokens=8, temperature=0)

    async def async_chat_stream() -> str:
        aclient = openai.AsyncOpenAI(base_url=http_url + "/v1", api_key="unused", max_retries=0)
        parts = []
        async for chunk in await aclient.chat.completions.create(
            model=model.name, messages=messages, max_tokens=8, temperature=0, stream=True
        ):
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
        await aclient.close()
        return "".join(parts)

    assert asyncio.run(async_chat_stream()) == chat.choices[0].message.content


def test_metrics_name_decisions_declines_retries_stale_pages_and_store_bytes(cluster: tuple[str, Path]) -> None:
    http_url, model = cluster
    httpx.post(
        http_url + "/v1/completions",
        json={"model": model.name, "prompt": "x y z " * 40, "max_tokens": 4, "temperature": 0},
        timeout=60,
    )

    def scraped() -> str | None:
        text = httpx.get(http_url + "/metrics").text
        stored = [
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("kvrelay_chunk_store_bytes{") and 'tier="ssd"' in line
        ]
        return text if stored and max(stored) > 0 else None

    text = wait_until(scraped, 20, "a heartbeat reporting the checkpointed chunks")
    accepted = re.search(r'kvrelay_routing_decisions_total\{outcome="accepted"\} (\d+)', text)
    assert accepted and int(accepted.group(1)) >= 1
    for name in (
        "kvrelay_retries_total",
        "kvrelay_router_queue_requests",
        "kvrelay_router_queue_refused_total",
        "kvrelay_stale_messages_dropped_total",
        "kvrelay_declines_total",
        "kvrelay_ttft_seconds_bucket",
        "kvrelay_inter_token_seconds_bucket",
        "kvrelay_cached_tokens_total",
        'kvrelay_pages_reserved{worker="w1"}',
        'kvrelay_pages_free{worker="w2"}',
        "kvrelay_pages_cached",
        "kvrelay_pages_in_use",
    ):
        assert name in text, f"{name} is missing from /metrics"


def _scraped_reuse(text: str) -> dict[str, int]:
    """The ``kvrelay_reuse_*_tokens_total`` counters of a ``/metrics`` page, keyed as ``/cluster`` keys them."""
    found = dict(re.findall(r"^kvrelay_reuse_(\w+)_tokens_total (\S+)$", text, re.MULTILINE))
    return {f"{figure}_tokens": int(float(value)) for figure, value in found.items()}


def test_reuse_figures_agree_with_usage_on_cluster_and_metrics(cluster: tuple[str, Path]) -> None:
    """One prompt sent until a request reuses it: the routing captured no more than was available, the workers
    delivered exactly the cached tokens the responses' usage reports, and /metrics says what /cluster says."""
    http_url, model = cluster
    before = httpx.get(http_url + "/cluster").json()["reuse"]
    prompt = "reuse is measured where the router decides and where the worker restores " * 12
    cached: list[int] = []

    def reused() -> int | None:
        body = httpx.post(
            http_url + "/v1/completions",
            json={"model": model.name, "prompt": prompt, "max_tokens": 2, "temperature": 0},
            timeout=60,
        ).json()
        cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
        return cached[-1] or None

    wait_until(reused, 30, "a request that reuses the prompt's chunks", every_s=0.2)
    after = httpx.get(http_url + "/cluster").json()["reuse"]
    delta = {k: after[k] - before[k] for k in after}
    assert set(after) == {"available_tokens", "captured_tokens", "delivered_tokens"}
    assert delta["delivered_tokens"] == sum(cached) > 0
    assert 0 < delta["captured_tokens"] <= delta["available_tokens"]
    assert _scraped_reuse(httpx.get(http_url + "/metrics").text) == after


ROUTER_SPANS = {"ingress", "route", "offer", "result"}
WORKER_SPANS = {"admission", "prefill", "decode"}


def test_one_requests_spans_cross_router_and_worker_processes_in_the_clients_trace(
    cluster: tuple[str, Path], collector: Collector
) -> None:
    http_url, model = cluster
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    response = httpx.post(
        http_url + "/v1/completions",
        json={"model": model.name, "prompt": "spans of one request " * 6, "max_tokens": 3, "temperature": 0},
        headers={"traceparent": f"00-{trace_id}-{client_span}-01"},
        timeout=60,
    )
    assert response.status_code == 200

    def complete() -> list[ReceivedSpan] | None:
        spans = collector.of_trace(trace_id)
        return spans if {s.name for s in spans} >= ROUTER_SPANS | WORKER_SPANS else None

    spans = wait_until(complete, 30, f"the router's and a worker's spans of trace {trace_id}", every_s=0.2)
    by_name = {s.name: s for s in spans}
    assert {s.service for s in spans if s.name in ROUTER_SPANS} == {"kvrelay-router"}
    assert {s.service for s in spans if s.name in WORKER_SPANS} == {"kvrelay-worker"}
    ingress, offer = by_name["ingress"], by_name["offer"]
    assert ingress.parent_span_id == client_span
    assert {by_name[n].parent_span_id for n in ("route", "offer", "result")} == {ingress.span_id}
    assert {by_name[n].parent_span_id for n in WORKER_SPANS} == {offer.span_id}
    rid = ingress.attributes["kvrelay.request_id"]
    assert all(s.attributes["kvrelay.request_id"] == rid for s in spans)
    assert by_name["admission"].attributes["kvrelay.worker_id"] == offer.attributes["kvrelay.worker_id"]
    assert by_name["decode"].attributes["kvrelay.generated_tokens"] == 3
    assert by_name["result"].attributes["kvrelay.finish_reason"] == "length"
    assert by_name["prefill"].end_ns <= by_name["decode"].start_ns + 1_000_000


def test_cluster_shows_each_live_workers_measured_speeds(cluster: tuple[str, Path]) -> None:
    """An operator reads why the router prefers one worker from /cluster: each worker's queue delay and the speeds
    it measured (its calibration at start at least)."""
    http_url, _ = cluster
    workers = httpx.get(http_url + "/cluster").json()["workers"]
    assert workers
    for view in workers.values():
        assert view["prefill_s_per_token"] > 0 and view["decode_s_per_token"] > 0, view
        assert view["queue_delay_s"] >= 0, view
        assert view["per_request_s"] == 0.0, view  # a native worker's queue and decode steps count its lanes
