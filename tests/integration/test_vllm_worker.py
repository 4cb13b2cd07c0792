"""kvrelay workers serving through real vLLM servers: residency from KV events, admission, cancellation, failover.

The two vLLM servers are the session's (``vllm_engines``, 64 blocks of 64 tokens each). The in-process tests
drive ``VllmWorker`` with the messages a router would send; the process tests run twice: ``kvrelay router``
with two ``kvrelay worker --engine vllm`` processes in front of them, and ``kvrelay router --vllm-engine`` driving
them from its own process (what ``kvrelay cluster --engine vllm`` deploys); either way the workers are v1 and v2.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvrelay.engines.vllm.host import VllmWorker
from kvrelay.launch.child import ChildProcess
from kvrelay.launch.vllm_server import VllmServer, attached_router_flags
from kvrelay.launch.vllm_worker import VllmSettings, build_vllm_worker
from kvrelay.protocol.chunk_keys import prompt_chain
from kvrelay.protocol.messages import Assignment, Cancel, Delta, Offer, OfferResult, Residency, Result, WireMessage
from tests.support.processes import Router, stop_all, stream_completion, wait_until
from tests.support.vllm_cluster import direct_completion, engine_counts, routed_completion, settle, vllm_worker

BLOCK = 64


class Collector:
    """Replies and published messages of an in-process worker, with an event per arrival."""

    def __init__(self) -> None:
        self.messages: list[WireMessage] = []
        self.changed = asyncio.Event()

    def __call__(self, message: WireMessage) -> bool:
        self.messages.append(message)
        self.changed.set()
        return True

    async def wait(self, predicate: Any, timeout: float, what: str) -> Any:
        async def until() -> Any:
            while not (found := predicate(self.messages)):
                self.changed.clear()
                await self.changed.wait()
            return found

        try:
            return await asyncio.wait_for(until(), timeout)
        except TimeoutError:
            raise AssertionError(f"no {what} within {timeout} s; got {self.messages[-5:]}") from None


def make_offer(host: VllmWorker, rid: str, prompt: list[int], max_new: int) -> Offer:
    return Offer(
        assignment=Assignment(rid, 1),
        worker_id=host.worker_id,
        epoch=host.epoch,
        model=host.me.model,
        model_fingerprint=host.me.fingerprint.hex(),
        prompt=tuple(prompt),
        max_new_tokens=max_new,
    )


def result_of(rid: str) -> Any:
    return lambda ms: next((m for m in ms if isinstance(m, Result) and m.assignment.request_id == rid), None)


def accepted(rid: str) -> Any:
    return lambda ms: next((m for m in ms if isinstance(m, OfferResult) and m.assignment.request_id == rid), None)


def test_kv_events_become_the_routers_chain_and_a_full_engine_declines(vllm_engines: list[VllmServer]) -> None:
    engine = vllm_engines[0]

    async def scenario() -> None:
        parts = await build_vllm_worker(VllmSettings("v-inproc", engine.spec.url, engine.spec.events_url))
        host, published, replies = parts.controller, Collector(), Collector()
        assert host.figures.checkpoint_tokens == 0  # vLLM's default, read from the real /metrics (no warning: Llama)
        host.publish = published
        parts.start()
        try:
            await asyncio.sleep(0.5)  # the subscriber's connection (a ZMQ SUB drops what precedes it)
            prompt = [7 + (i * 13) % 300 for i in range(5 * BLOCK + 9)]
            host.on_offer(make_offer(host, "warm", prompt, 4), replies)
            result = await replies.wait(result_of("warm"), 60, "result")
            assert result.finish_reason == "length" and len(result.tokens) == 4
            chain = prompt_chain(host.me.fingerprint, prompt, BLOCK)  # what the router computes for the prompt

            def stored(ms: list[WireMessage]) -> set[bytes]:
                return {k for m in ms if isinstance(m, Residency) for k in m.stored}

            await published.wait(lambda ms: set(chain) <= stored(ms), 30, "residency of the prompt's chain")
            assert all(m.tier == "gpu" and m.epoch == host.epoch for m in published.messages)

            # Full: two offers of 32 blocks each take the engine's 64; the third is declined, naming the reason.
            before = engine_counts(engine)
            long = [[11 + (i * 7 + j) % 300 for i in range(1000)] for j in range(3)]
            for j in range(2):
                host.on_offer(make_offer(host, f"big{j}", long[j], 1040), replies)
                assert (await replies.wait(accepted(f"big{j}"), 10, "an answer")).accepted
            host.on_offer(make_offer(host, "big2", long[2], 1040), replies)
            declined = await replies.wait(accepted("big2"), 10, "an answer")
            assert not declined.accepted and declined.reason == "no_capacity" and "blocks" in declined.detail
            assert host.heartbeat().pages_free == 0

            # Cancellation: the router's Cancel closes the streams, vLLM aborts both requests, the blocks return.
            await replies.wait(lambda ms: sum(isinstance(m, Delta) for m in ms) >= 2, 60, "tokens of the big offers")
            for j in range(2):
                host.on_cancel(Cancel(assignment=Assignment(f"big{j}", 1), worker_id=host.worker_id))
            await asyncio.wait_for(host.quiesced.wait(), 30)
            big_results = [m for m in replies.messages if isinstance(m, Result) and m.assignment.request_id != "warm"]
            assert big_results == []
            stopped = await asyncio.to_thread(
                wait_until, lambda: (c := engine_counts(engine))["running"] == 0 and c, 30, "vLLM to run nothing"
            )
            assert stopped["done"] == before["done"], "an aborted request finished"
            assert stopped["generated"] - before["generated"] < 2 * 1040, "the requests ran to their budget"
            assert host.heartbeat().pages_reserved == 0
        finally:
            await parts.aclose()

    asyncio.run(scenario())


@pytest.fixture(scope="module", params=["worker_processes", "attached"])
def vllm_cluster(
    request: pytest.FixtureRequest,
    vllm_engines: list[VllmServer],
    vllm_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Router, list[ChildProcess]]]:
    """A router with workers v1 and v2, each in front of one session engine, and the process that logs each
    worker: a ``kvrelay worker --engine vllm`` process each, or the router driving both (``--vllm-engine``)."""
    home = tmp_path_factory.mktemp(f"vllm-{request.param}")
    if request.param == "attached":
        router = Router(home, vllm_model, *attached_router_flags([e.spec for e in vllm_engines]))
        workers = [router.child, router.child]
    else:
        router = Router(home, vllm_model)
        workers = [vllm_worker(home, f"v{i}", router.workers_url, e) for i, e in enumerate(vllm_engines, start=1)]
    try:
        for worker in workers:
            if worker is not router.child:
                worker.wait_for(r"kvrelay worker ready", 120)
        wait_until(lambda: sorted(router.live_workers()) == ["v1", "v2"] or None, 30, "two live vLLM workers")
        yield router, workers
    finally:
        stop_all(list(dict.fromkeys([*workers, router.child])))


def test_routing_follows_residency_learned_from_kv_events(
    vllm_cluster: tuple[Router, list[ChildProcess]], vllm_engines: list[VllmServer], vllm_model: Path
) -> None:
    router, _ = vllm_cluster
    model = vllm_model.name
    prefix = [17 + (i * 5) % 290 for i in range(6 * BLOCK)]
    # Warm the second engine behind kvrelay's back: only its KV events can tell the router (ties go to v1).
    direct_completion(vllm_engines[1], [*prefix, 3], 1)
    settle(router, "v2")
    before = [engine_counts(e)["done"] for e in vllm_engines]
    for k in range(3):
        wait_until(lambda: not router.cluster()["requests"] or None, 30, "no request in flight")
        answer = routed_completion(router.http_url, model, [*prefix, 40 + k, 41, 42], 4)
        assert answer["finish"] == "length" and answer["usage"]["completion_tokens"] == 4
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 6 * BLOCK - BLOCK, answer
    after = [engine_counts(e)["done"] for e in vllm_engines]
    assert (after[0] - before[0], after[1] - before[1]) == (0, 3), (before, after)


def kill_engine_mid_stream(router: Router, worker: ChildProcess, victim: VllmServer, start: list[int]) -> bool:
    """Two greedy streams of 1,500 tokens starting with ``start`` through the router, ``kill -9`` of ``victim`` at
    their first sign, its restart; every stream completes with its full token count. True when the kill cut a
    stream (the router retried): the tiny model can generate all its tokens before the first one reaches the
    client through a starved 2-core machine (seen), and then no stream was cut.

    357 + 1,500 tokens are 30 of an engine's 64 blocks: long enough to be cut, and both streams fit one engine,
    so the survivor can take both continuations at once."""
    budget, streams = 1500, 2
    wait_until(lambda: not router.cluster()["requests"] or None, 30, "no request in flight")
    epoch_before = router.live_workers()["v1"]["epoch"]
    retries_before = router.cluster()["router_counters"].get("retries", 0)
    results: dict[int, dict[str, Any]] = {}
    streaming = [threading.Event() for _ in range(streams)]

    def consume(i: int) -> None:
        chunks: list[dict[str, Any]] = []
        prompt = [*start, 100 + i, *range(30, 130)]
        for chunk in stream_completion(router.http_url, router.model_dir.name, prompt, budget):
            chunks.append(chunk)
            streaming[i].set()
        choices = [c for c in chunks if c.get("choices")]
        results[i] = {"last": chunks[-1], "usage": chunks[-1].get("usage"), "finish": choices[-1] if choices else None}

    threads = [threading.Thread(target=consume, args=(i,), daemon=True) for i in range(streams)]
    for thread in threads:
        thread.start()
    # The first sign of a stream: a token the client saw or a request vLLM's /metrics shows running.
    wait_until(
        lambda: any(e.is_set() for e in streaming) or engine_counts(victim)["running"] >= 1 or None,
        60,
        "a stream running on the engine to kill",
        every_s=0.02,
    )
    back = worker.mark()
    victim.kill()  # kill -9 of the engine's whole process group, mid-stream
    for thread in threads:
        thread.join(300)
    assert sorted(results) == list(range(streams)), (results, router.cluster()["router_counters"])
    for result in results.values():
        assert result["usage"] and result["usage"]["completion_tokens"] == budget, result
        assert result["finish"]["choices"][0]["finish_reason"] == "length", result
    victim.start().wait_ready()
    worker.wait_for(r"vLLM engine at \S+ is back", 60, back)
    wait_until(lambda: router.live_workers()["v1"]["epoch"] > epoch_before or None, 30, "v1 in a new epoch")
    return bool(router.cluster()["router_counters"].get("retries", 0) > retries_before)


@pytest.mark.timeout(900)
def test_killed_engine_streams_complete_and_its_restart_clears_the_routers_belief(
    vllm_cluster: tuple[Router, list[ChildProcess]], vllm_engines: list[VllmServer], vllm_model: Path
) -> None:
    router, workers = vllm_cluster
    model, victim = vllm_model.name, vllm_engines[0]
    # Two prefixes resident on v1's engine only: the streams start with the first, so the router sends them
    # there by residency; the second is for after the restart, which must have cleared the router's belief in it.
    lead = [29 + (i * 7) % 270 for i in range(4 * BLOCK)]
    prefix = [23 + (i * 11) % 280 for i in range(4 * BLOCK)]
    for _ in range(3):  # until a kill lands mid-stream (see kill_engine_mid_stream)
        direct_completion(victim, [*lead, 5], 1)
        direct_completion(victim, [*prefix, 5], 1)
        settle(router, "v1")
        if kill_engine_mid_stream(router, workers[0], victim, lead):
            break
    else:
        raise AssertionError("no kill of three landed while a stream was running on the engine")
    # Had the router kept v1's old residency, it would offer v1 a gpu route the worker declines (stale_route).
    counters = router.cluster()["router_counters"]
    answer = routed_completion(router.http_url, model, [*prefix, 77, 78], 4)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, answer
    after = router.cluster()["router_counters"]
    for name in ("declined_stale_route", "retries"):
        assert after.get(name, 0) == counters.get(name, 0), (name, counters, after)
