"""The in-process link between the router and a worker host (``transport.local_link``), driving a real vLLM
worker host whose engine is unreachable (its offers end with an error result), and ``kvrelay router
--vllm-engine``'s argument parsing."""

from __future__ import annotations

import asyncio

import pytest

from kvrelay.cli.router import vllm_engines
from kvrelay.protocol.messages import Cancel, Fenced, Heartbeat, OfferResult, Result, WireMessage
from kvrelay.transport.local_link import LocalLink
from tests.unit.test_vllm_engine_parts import offer, worker_host


class Sink:
    def __init__(self) -> None:
        self.messages: list[WireMessage] = []
        self.changed = asyncio.Event()

    def receive(self, message: WireMessage) -> None:
        self.messages.append(message)
        self.changed.set()

    async def until(self, probe: object, timeout_s: float = 10.0) -> None:
        async def wait() -> None:
            while not probe():  # type: ignore[operator]
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(wait(), timeout_s)


def test_a_local_link_carries_offers_results_and_fencing_in_order() -> None:
    async def scenario() -> None:
        host, _ = worker_host()
        sink = Sink()
        link = LocalLink(host, sink, heartbeat_interval_s=0.05)
        link.start()
        try:
            await sink.until(lambda: sum(isinstance(m, Heartbeat) for m in sink.messages) >= 2)
            link.deliver(offer())
            await sink.until(lambda: any(isinstance(m, Result) for m in sink.messages))
            answers = [m for m in sink.messages if isinstance(m, OfferResult | Result)]
            assert isinstance(answers[0], OfferResult) and answers[0].accepted
            assert isinstance(answers[1], Result) and answers[1].error and "127.0.0.1:9" in answers[1].error

            old = host.epoch
            link.deliver(Fenced(worker_id="v1", epoch=old))
            await sink.until(lambda: any(isinstance(m, Heartbeat) and m.epoch > old for m in sink.messages))
            assert link.counters["fenced_notices"] == 1

            def boom(cancel: Cancel) -> None:
                raise RuntimeError("host failure")

            host.on_cancel = boom  # type: ignore[method-assign]
            link.deliver(Cancel(assignment=answers[0].assignment, worker_id="v1"))
            link.deliver(host.heartbeat())  # router-bound: not for a worker
            await sink.until(lambda: link.counters["host_errors"] == 1)
            seen = len(sink.messages)
            await sink.until(lambda: len(sink.messages) > seen)  # still beating after the failure
            assert link.counters["wrong_direction"] == 1
        finally:
            await link.close()

    asyncio.run(scenario())


def test_vllm_engine_arguments_become_workers_v1_v2() -> None:
    engines = vllm_engines(["http://a:1/,tcp://a:2", "http://b:3"], "float32", ["/m"], lanes=16)
    assert [(e.worker_id, e.engine_url, e.kv_events, e.model, e.dtype, e.max_lanes) for e in engines] == [
        ("v1", "http://a:1", "tcp://a:2", "/m", "float32", 16),
        ("v2", "http://b:3", None, "/m", "float32", 16),
    ]
    assert vllm_engines(["http://a:1"], "bfloat16", ["/m", "/n"])[0].model is None  # each engine's own
    for bad in ("a:1", "http://a:1,a:2"):
        with pytest.raises(ValueError, match="URL,KV_EVENTS"):
            vllm_engines([bad], "float32", [])
