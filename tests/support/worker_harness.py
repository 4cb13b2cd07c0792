"""A real worker controller on a tiny real model, with helpers to send offers and collect replies."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvrelay.models.loading.fingerprint import model_fingerprint
from kvrelay.models.loading.loader import load_artifacts
from kvrelay.protocol.messages import (
    Assignment,
    Cancel,
    Delta,
    Heartbeat,
    Offer,
    OfferResult,
    Result,
    RouteSegment,
    Sampling,
    WireMessage,
)
from kvrelay.worker.admission import WorkerIdentity
from kvrelay.worker.handlers import RestoreHandler
from kvrelay.worker.host import WorkerController
from kvrelay.worker.runtime.engine import Engine, EngineOptions
from kvrelay.worker.runtime.jobs import Job

GREEDY = Sampling()
"""The default sampling of an offer: greedy, no seed."""


@dataclass
class Replies:
    """Everything the worker sent back for one assignment, with an event per arrival."""

    messages: list[WireMessage] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    def __call__(self, message: WireMessage) -> None:
        self.messages.append(message)
        self.arrived.set()

    @property
    def deltas(self) -> list[Delta]:
        return [m for m in self.messages if isinstance(m, Delta)]

    @property
    def tokens(self) -> list[int]:
        return [t for d in self.deltas for t in d.tokens]

    def of(self, kind: type) -> list[WireMessage]:
        return [m for m in self.messages if isinstance(m, kind)]

    async def wait_for(self, kind: type, timeout: float = 30.0) -> WireMessage:
        async def until() -> WireMessage:
            while True:
                found = self.of(kind)
                if found:
                    return found[0]
                self.arrived.clear()
                await self.arrived.wait()

        return await asyncio.wait_for(until(), timeout)

    async def wait_tokens(self, n: int, timeout: float = 30.0) -> None:
        async def until() -> None:
            while len(self.tokens) < n and not self.of(Result):
                self.arrived.clear()
                await self.arrived.wait()

        await asyncio.wait_for(until(), timeout)


class WorkerHarness:
    """Model, KV pages, runtime, pool and controller of one worker (call inside a running loop)."""

    def __init__(
        self,
        model_dir: Path,
        num_pages: int = 64,
        lanes: int = 4,
        restore: RestoreHandler | None = None,
        epoch: int = 1,
        context_limit: int = 4096,
        share_prefill: bool = True,
    ) -> None:
        self.artifacts = load_artifacts(model_dir, torch.float32)
        config = self.artifacts.config
        engine = Engine.from_artifacts(
            self.artifacts,
            torch.float32,
            EngineOptions(kv_tokens=num_pages * 16, page_tokens=16, num_lanes=lanes, token_budget=256, chunk_tokens=64),
        )
        self.model, self.kv, self.runtime = engine.model, engine.runtime.kv, engine.runtime
        self.fingerprint = self.artifacts.fingerprint
        self.identity = WorkerIdentity("w0", epoch, "tiny", self.fingerprint, context_limit)
        self.published: list[WireMessage] = []
        """Residency messages the worker published, in order."""
        self.heartbeats: list[Heartbeat] = []
        """Heartbeats it published between the periodic ones (after a prefill ended)."""
        self.controller = WorkerController(
            self.identity,
            engine.pool,
            self.runtime,
            config.kv_bytes_per_token(4),
            restore=restore,
            publish=self._published,
            share_prefill=share_prefill,
        )
        self.controller.pool.on_residency = self.controller.publish_residency
        self.pool = self.controller.pool

    def _published(self, message: WireMessage) -> None:
        if isinstance(message, Heartbeat):
            self.heartbeats.append(message)
        else:
            self.published.append(message)

    def offer(
        self,
        rid: str,
        prompt: tuple[int, ...],
        max_new: int,
        attempt: int = 1,
        route: tuple[RouteSegment, ...] = (),
        sampling: Sampling = GREEDY,
        priority: float = 0.0,
    ) -> tuple[Offer, Replies]:
        offer = Offer(
            assignment=Assignment(rid, attempt),
            worker_id="w0",
            epoch=self.identity.epoch,
            model="tiny",
            model_fingerprint=self.fingerprint.hex(),
            prompt=prompt,
            max_new_tokens=max_new,
            sampling=sampling,
            route=route,
            priority=priority,
        )
        replies = Replies()
        self.controller.on_offer(offer, replies)
        return offer, replies

    def cancel(self, offer: Offer) -> None:
        self.controller.on_cancel(Cancel(assignment=offer.assignment, worker_id="w0"))

    def reference(self, prompt: tuple[int, ...], max_new: int) -> list[int]:
        """Greedy tokens of the runtime alone, on pages nobody else uses (the highest ones)."""
        pages = -(-(len(prompt) + max_new) // 16)
        table = tuple(range(self.kv.num_pages - pages, self.kv.num_pages))
        return list(self.runtime.generate(Job(prompt, table, 0, max_new), timeout=60).tokens)

    async def quiesce(self, timeout: float = 30.0) -> None:
        await asyncio.wait_for(self.controller.quiesced.wait(), timeout)

    def close(self) -> None:
        self.runtime.close()


def greedy_reference(model_dir: Path, prompt: list[int] | tuple[int, ...], n: int) -> list[int]:
    """The runtime's own greedy continuation of ``prompt`` on a fresh worker (outside any event loop)."""

    async def main() -> list[int]:
        h = WorkerHarness(model_dir)
        try:
            return h.reference(tuple(prompt), n)
        finally:
            h.close()

    return asyncio.run(main())


__all__ = ["OfferResult", "Replies", "Result", "WorkerHarness", "greedy_reference", "model_fingerprint"]
