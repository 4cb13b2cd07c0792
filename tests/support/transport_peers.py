"""Protocol peers for transport tests over real WebSockets on loopback.

``ScriptedHost`` is a worker host (``transport.worker_endpoint.WorkerHost``)
that answers offers from a script: it is the protocol peer of the transport,
not a mock of it. Token values depend only on the absolute stream position
(``token_at``), so a continuation on another worker yields the same stream.
``RouterSide`` runs a ``ClusterRouter`` behind a ``RouterEndpoint`` and records
the worker-unavailable events the endpoint emits.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
from websockets.asyncio.client import ClientConnection, connect

from kvrelay.core.router.events import Outcome, Request
from kvrelay.core.router.machine import RouterConfig, new_router
from kvrelay.protocol.messages import (
    Cancel,
    Delta,
    Heartbeat,
    Offer,
    OfferResult,
    Result,
    WireMessage,
)
from kvrelay.router.cluster_router import ClusterRouter, Consumer
from kvrelay.transport.auth import bearer_header
from kvrelay.transport.router_endpoint import RouterEndpoint, registry_liveness
from kvrelay.transport.worker_endpoint import Backoff, Reply, WorkerEndpoint
from tests.support.router_driver import heartbeat

SECRET = b"test-secret-0123456789abcdef"
FAST_BACKOFF = Backoff(initial_s=0.02, max_s=0.2)

Action = Literal["serve", "hold", "decline"]


def token_at(position: int) -> int:
    return 100 + position


class ScriptedHost:
    """Answers offers: ``serve`` (accept, one delta per token, result), ``hold`` (accept,
    ``hold_after`` deltas, then silence), ``decline`` (no_capacity). Default action: serve."""

    def __init__(
        self,
        worker_id: str,
        epoch: int = 1,
        script: dict[str, Action] | None = None,
        hold_after: int = 2,
        new_epoch_on_disconnect: bool = True,
        **heartbeat_fields: Any,
    ) -> None:
        self.worker_id = worker_id
        self.epoch = epoch
        self.seq = 0
        self.script = script or {}
        self.hold_after = hold_after
        self.new_epoch_on_disconnect = new_epoch_on_disconnect
        self.heartbeat_fields = heartbeat_fields
        self.offers: list[Offer] = []
        self.cancels: list[Cancel] = []
        self.disconnects: list[str] = []
        self.offer_arrived = asyncio.Event()

    def heartbeat(self) -> Heartbeat:
        self.seq += 1
        return heartbeat(self.worker_id, self.epoch, self.seq, **self.heartbeat_fields)

    def on_offer(self, offer: Offer, reply: Reply) -> None:
        self.offers.append(offer)
        self.offer_arrived.set()
        a = offer.assignment
        if offer.epoch != self.epoch:
            reply(
                OfferResult(
                    assignment=a, worker_id=self.worker_id, epoch=self.epoch, accepted=False, reason="wrong_epoch"
                )
            )
            return
        action = self.script.get(a.request_id, "serve")
        if action == "decline":
            reply(
                OfferResult(
                    assignment=a, worker_id=self.worker_id, epoch=self.epoch, accepted=False, reason="no_capacity"
                )
            )
            return
        reply(OfferResult(assignment=a, worker_id=self.worker_id, epoch=self.epoch, accepted=True))
        tokens = tuple(token_at(offer.generated_before + i) for i in range(offer.max_new_tokens))
        count = self.hold_after if action == "hold" else len(tokens)
        for seq in range(count):
            reply(Delta(assignment=a, worker_id=self.worker_id, seq=seq, tokens=(tokens[seq],)))
        if action == "serve":
            reply(Result(assignment=a, worker_id=self.worker_id, tokens=tokens, finish_reason="length"))

    def on_cancel(self, cancel: Cancel) -> None:
        self.cancels.append(cancel)

    def on_disconnect(self, router_url: str) -> None:
        """The router fenced this epoch: come back in a new one (unless told to play a stale process)."""
        self.disconnects.append(router_url)
        if self.new_epoch_on_disconnect:
            self.epoch += 1
            self.seq = 0

    async def next_offer(self, timeout_s: float = 5.0) -> Offer:
        seen = len(self.offers)
        async with asyncio.timeout(timeout_s):
            while len(self.offers) == seen:
                self.offer_arrived.clear()
                await self.offer_arrived.wait()
        return self.offers[-1]


class PlainHost:
    """Only the required host interface (no ``on_disconnect``): keeps its epoch across reconnects."""

    def __init__(self, inner: ScriptedHost) -> None:
        self._inner = inner
        self.worker_id = inner.worker_id
        self.epoch = inner.epoch

    def heartbeat(self) -> Heartbeat:
        return self._inner.heartbeat()

    def on_offer(self, offer: Offer, reply: Reply) -> None:
        self._inner.on_offer(offer, reply)

    def on_cancel(self, cancel: Cancel) -> None:
        self._inner.on_cancel(cancel)


@dataclass
class Stream:
    tokens: list[int] = field(default_factory=list)
    done: asyncio.Future[Outcome] = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    def consumer(self) -> Consumer:
        def on_delta(index: int, new: tuple[int, ...]) -> None:
            assert index == len(self.tokens), f"gap or duplicate at {index}"
            self.tokens.extend(new)

        return Consumer(on_delta, self.done.set_result)

    async def outcome(self, timeout_s: float = 10.0) -> Outcome:
        return await asyncio.wait_for(asyncio.shield(self.done), timeout_s)


class RouterSide:
    """A ClusterRouter behind a RouterEndpoint, recording the unavailable events it is fed."""

    def __init__(self, config: RouterConfig | None = None, port: int = 0, **endpoint_options: Any) -> None:
        self.endpoint = RouterEndpoint(SECRET, port=port, **endpoint_options)
        self.router = ClusterRouter(new_router(config or RouterConfig()), self.endpoint.send, tick_s=0.05)
        self.unavailable: list[tuple[str, int]] = []

    def receive(self, message: WireMessage) -> None:
        self.router.receive(message)

    def worker_unavailable(self, worker_id: str, epoch: int) -> None:
        self.unavailable.append((worker_id, epoch))
        self.router.worker_unavailable(worker_id, epoch)

    async def start(self) -> RouterSide:
        await self.endpoint.start(self, is_live=registry_liveness(self.router))
        self.router.start()
        return self

    async def close(self) -> None:
        await self.endpoint.close()
        await self.router.close()

    @property
    def url(self) -> str:
        return self.endpoint.url

    def submit(self, request_id: str, max_new: int = 4, prompt_len: int = 20) -> Stream:
        stream = Stream()
        self.router.submit(Request(request_id, "m", tuple(range(prompt_len)), max_new), stream.consumer())
        return stream

    async def wait_route(self, worker_id: str, epoch: int, timeout_s: float = 5.0) -> None:
        """Until the router endpoint routes ``worker_id`` in ``epoch`` and the router holds it live."""

        def routed() -> bool:
            route = self.endpoint.table.routes.get(worker_id)
            entry = self.router.state.registry.live_entry(worker_id)
            return route is not None and route.epoch == epoch and entry is not None and entry.epoch == epoch

        await self.endpoint.wait_until(routed, timeout_s)


async def start_worker(
    host: ScriptedHost | PlainHost, *urls: str, seed: int = 0, interval_s: float = 0.1
) -> WorkerEndpoint:
    endpoint = WorkerEndpoint(host, urls, SECRET, heartbeat_interval_s=interval_s, backoff=FAST_BACKOFF, seed=seed)
    await endpoint.start()
    return endpoint


async def raw_peer(url: str, secret: bytes | None = SECRET, **options: Any) -> ClientConnection:
    """A bare authenticated WebSocket client (for sending arbitrary frames)."""
    headers = [bearer_header(secret)] if secret is not None else []
    return await connect(url, additional_headers=headers, compression=None, proxy=None, max_size=None, **options)


def pack(obj: object) -> bytes:
    return msgspec.msgpack.encode(obj)
