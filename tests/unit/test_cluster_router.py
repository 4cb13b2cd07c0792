"""The asyncio interpreter: real timers fire offer timeouts; consumers get one gapless stream."""

from __future__ import annotations

import asyncio

from kvrelay.core.router.events import Outcome, Request
from kvrelay.core.router.machine import RouterConfig, new_router
from kvrelay.protocol.messages import Delta, Offer, OfferResult, Result, WireMessage
from kvrelay.router.cluster_router import ClusterRouter, Consumer
from tests.support.router_driver import heartbeat


class Inbox:
    def __init__(self) -> None:
        self.messages: list[tuple[str, WireMessage]] = []
        self.arrived = asyncio.Event()

    def send(self, worker_id: str, message: WireMessage) -> None:
        self.messages.append((worker_id, message))
        self.arrived.set()

    async def next(self, kind: type) -> tuple[str, WireMessage]:
        while True:
            for item in self.messages:
                if isinstance(item[1], kind):
                    self.messages.remove(item)
                    return item
            self.arrived.clear()
            await asyncio.wait_for(self.arrived.wait(), 2.0)


def collect() -> tuple[Consumer, list[int], asyncio.Future[Outcome]]:
    tokens: list[int] = []
    done: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()

    def on_delta(index: int, new: tuple[int, ...]) -> None:
        assert index == len(tokens)
        tokens.extend(new)

    return Consumer(on_delta, done.set_result), tokens, done


def test_offer_timeout_fires_on_a_real_timer_and_reroutes() -> None:
    async def scenario() -> None:
        inbox = Inbox()
        router = ClusterRouter(new_router(RouterConfig(offer_timeout_s=0.05)), inbox.send)
        router.receive(heartbeat("w0"))
        router.receive(heartbeat("w1"))
        consumer, tokens, done = collect()
        router.submit(Request("r", "m", tuple(range(100)), 3), consumer)
        first_worker, first = await inbox.next(Offer)
        # Nobody answers: the timer cancels attempt 1 and offers attempt 2 elsewhere.
        second_worker, second = await inbox.next(Offer)
        assert second.assignment.attempt == 2 and second_worker != first_worker
        router.receive(OfferResult(assignment=second.assignment, worker_id=second_worker, epoch=1, accepted=True))
        router.receive(Delta(assignment=second.assignment, worker_id=second_worker, seq=0, tokens=(4, 5)))
        router.receive(
            Result(assignment=second.assignment, worker_id=second_worker, tokens=(4, 5, 6), finish_reason="length")
        )
        outcome = await asyncio.wait_for(done, 2.0)
        assert tokens == [4, 5, 6] and outcome.tokens == (4, 5, 6) and outcome.attempts == 2
        await router.close()

    asyncio.run(scenario())


def test_a_failing_consumer_callback_is_contained() -> None:
    async def scenario() -> None:
        inbox = Inbox()
        router = ClusterRouter(new_router(), inbox.send)
        router.receive(heartbeat("w0"))

        def explode(index: int, tokens: tuple[int, ...]) -> None:
            raise RuntimeError("consumer bug")

        outcomes: list[Outcome] = []
        router.submit(Request("r", "m", tuple(range(10)), 2), Consumer(explode, outcomes.append))
        wid, offer = await inbox.next(Offer)
        router.receive(Delta(assignment=offer.assignment, worker_id=wid, seq=0, tokens=(1,)))
        router.receive(Result(assignment=offer.assignment, worker_id=wid, tokens=(1, 2), finish_reason="length"))
        assert router.callback_errors == 2 and outcomes and outcomes[0].finish_reason == "length"
        await router.close()

    asyncio.run(scenario())


def test_durable_replicas_are_read_at_start_and_when_a_worker_epoch_begins() -> None:
    from kvrelay.facts.replica_map import ReplicaMap
    from kvrelay.protocol.chunk_keys import prompt_chain

    async def scenario() -> None:
        prompt = tuple(range(1, 64 * 4 + 2))
        chain = prompt_chain(b"m", prompt, 64)
        replicas = ReplicaMap()
        replicas.apply("object", "bucket", chain[:2], ())
        replicas.apply("ssd", "w1", chain, ())
        inbox = Inbox()
        router = ClusterRouter(new_router(RouterConfig()), inbox.send, replicas=replicas)
        router.start()  # reads every object replica
        assert len(router.state.index) == 2
        slow_peers = {"ram": 1e9, "ssd": 2.5e8, "peer": 1e7, "object": 1e7}
        router.receive(heartbeat("w0", restore_bytes_per_s=slow_peers))
        router.receive(heartbeat("w1", restore_bytes_per_s=slow_peers))  # its epoch begins: its ssd replicas join
        assert len(router.state.index) == 4
        consumer, _, _ = collect()
        router.submit(Request("r", "m", prompt, 3), consumer)
        worker, offer = await inbox.next(Offer)
        assert worker == "w1" and [(s.tier, s.chunks) for s in offer.route] == [("ssd", 4)]
        await router.close()

    asyncio.run(scenario())
