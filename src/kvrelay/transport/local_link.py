"""An in-process link between the router and a worker host on the same event loop (``kvrelay router --vllm-engine``).

Contract: one ``WorkerEndpoint`` link (``transport.worker_endpoint``) without the wire.

- ``start()`` hands the router the host's heartbeat and its residency snapshot (if it defines
  ``residency_snapshot``) at once, then a heartbeat every ``heartbeat_interval_s``; ``close()`` stops them.
- ``deliver(message)`` takes what the router sends this worker: an ``Offer`` goes to
  ``host.on_offer(offer, reply)``, a ``Cancel`` to ``host.on_cancel``, a ``Fenced`` notice to ``host.on_fenced``
  (if it defines it) followed by a fresh heartbeat and snapshot, so the new epoch is routed at once.
- The host's ``publish`` and the ``reply`` of an offer reach the router's ``sink.receive``.
- Every handover goes through ``loop.call_soon``, so neither side re-enters the other within a call, and
  messages keep their order (the loop runs callbacks first in, first out).
- A host callback that raises is logged and counted under ``host_errors``; the link keeps serving.

No frame is encoded: both sides hold the same immutable messages (``serve``'s embedded worker is handed its
messages the same way). A worker linked this way cannot lose its connection; it still starts new epochs on its
own (an engine restart), which the router fences as it would a remote worker's.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from typing import Protocol

from kvrelay.protocol.messages import Cancel, Fenced, Offer, WireMessage
from kvrelay.transport.worker_endpoint import WorkerHost

log = logging.getLogger(__name__)


class Sink(Protocol):
    """Where the worker's messages go: the router (or a tap in front of it)."""

    def receive(self, message: WireMessage) -> None: ...


class PublishingHost(WorkerHost, Protocol):
    """A worker host whose spontaneous messages (residency, heartbeats of its own) go to ``publish``."""

    publish: Callable[[WireMessage], object]


class LocalLink:
    """One worker host linked to the router in-process (see the module contract)."""

    def __init__(self, host: PublishingHost, sink: Sink, heartbeat_interval_s: float) -> None:
        self.host = host
        self.sink = sink
        self.heartbeat_interval_s = heartbeat_interval_s
        self.counters: Counter[str] = Counter()
        self._task: asyncio.Task[None] | None = None
        host.publish = self._to_router

    @property
    def worker_id(self) -> str:
        return self.host.worker_id

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._heartbeat_forever())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def deliver(self, message: WireMessage) -> None:
        """A message of the router for this worker (the router's ``send`` for this worker id)."""
        loop = asyncio.get_running_loop()
        match message:
            case Offer():
                loop.call_soon(self._call_host, self.host.on_offer, message, self._reply)
            case Cancel():
                loop.call_soon(self._call_host, self.host.on_cancel, message)
            case Fenced():
                self.counters["fenced_notices"] += 1
                on_fenced = getattr(self.host, "on_fenced", None)
                if on_fenced is not None:
                    loop.call_soon(self._call_host, on_fenced, message)
                    loop.call_soon(self._announce)
            case _:
                self.counters["wrong_direction"] += 1

    def _to_router(self, message: WireMessage) -> None:
        asyncio.get_running_loop().call_soon(self.sink.receive, message)

    def _reply(self, message: WireMessage) -> bool:
        self._to_router(message)
        return True

    def _announce(self) -> None:
        """A heartbeat of the current epoch, then the host's residency snapshot (if it defines one)."""
        self._call_host(lambda: self._to_router(self.host.heartbeat()))
        snapshot = getattr(self.host, "residency_snapshot", None)
        if snapshot is not None:

            def send_snapshot() -> None:
                for message in snapshot():
                    self._to_router(message)

            self._call_host(send_snapshot)

    async def _heartbeat_forever(self) -> None:
        self._announce()
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            self._call_host(lambda: self._to_router(self.host.heartbeat()))

    def _call_host(self, fn: Callable[..., object], *args: object) -> None:
        try:
            fn(*args)
        except Exception:
            self.counters["host_errors"] += 1
            log.exception("worker host callback %s failed", getattr(fn, "__qualname__", fn))
