"""A minimal synchronous driver of the pure router for unit tests: feeds events, collects effects."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvrelay.core.router.events import (
    DeliverDelta,
    DeliverResult,
    Effect,
    MessageReceived,
    Request,
    RequestArrived,
    SendCancel,
    SendOffer,
)
from kvrelay.core.router.machine import RouterConfig, new_router, step
from kvrelay.protocol.messages import (
    Assignment,
    Delta,
    Heartbeat,
    OfferResult,
    Residency,
    Result,
)


def heartbeat(worker_id: str, epoch: int = 1, seq: int = 1, **overrides: Any) -> Heartbeat:
    fields: dict[str, Any] = dict(
        worker_id=worker_id,
        epoch=epoch,
        seq=seq,
        models=("m",),
        pages_total=1000,
        pages_free=1000,
        page_tokens=16,
        chunk_tokens=64,
        prefill_s_per_token=1e-3,
        decode_s_per_token=0.02,
        restore_bytes_per_s={"ram": 1e9, "ssd": 2.5e8, "peer": 5e8, "object": 1e8},
        kv_bytes_per_token=1000,
        context_limit=100_000,
    )
    fields.update(overrides)
    return Heartbeat(**fields)


@dataclass
class Driver:
    config: RouterConfig = field(default_factory=RouterConfig)
    policy: str = "kvrelay"
    now: float = 0.0

    def __post_init__(self) -> None:
        self.state = new_router(self.config, self.policy)
        self.effects: list[Effect] = []
        self.streams: dict[str, list[int]] = {}
        self.results: dict[str, list[DeliverResult]] = {}

    def feed(self, event: Any) -> list[Effect]:
        self.state, fx = step(self.state, event)
        self.effects.extend(fx)
        for e in fx:
            if isinstance(e, DeliverDelta):
                stream = self.streams.setdefault(e.request_id, [])
                assert e.index == len(stream), f"gap or duplicate at {e.index} (have {len(stream)})"
                stream.extend(e.tokens)
            elif isinstance(e, DeliverResult):
                self.results.setdefault(e.request_id, []).append(e)
        return fx

    def message(self, msg: Any) -> list[Effect]:
        return self.feed(MessageReceived(self.now, msg))

    def request(self, rid: str, prompt: tuple[int, ...], max_new: int = 4, model: str = "m") -> list[Effect]:
        return self.feed(RequestArrived(self.now, Request(rid, model, prompt, max_new)))

    def residency(self, worker_id: str, tier: str, keys: tuple[bytes, ...], epoch: int = 1, seq: int = 1) -> None:
        self.message(Residency(worker_id=worker_id, epoch=epoch, seq=seq, tier=tier, stored=keys))

    def accept(self, offer: SendOffer) -> list[Effect]:
        o = offer.offer
        return self.message(OfferResult(assignment=o.assignment, worker_id=o.worker_id, epoch=o.epoch, accepted=True))

    def decline(self, offer: SendOffer, reason: str) -> list[Effect]:
        o = offer.offer
        return self.message(
            OfferResult(assignment=o.assignment, worker_id=o.worker_id, epoch=o.epoch, accepted=False, reason=reason)
        )

    def delta(self, a: Assignment, worker_id: str, seq: int, tokens: tuple[int, ...]) -> list[Effect]:
        return self.message(Delta(assignment=a, worker_id=worker_id, seq=seq, tokens=tokens))

    def result(self, a: Assignment, worker_id: str, tokens: tuple[int, ...], reason: str = "length") -> list[Effect]:
        return self.message(Result(assignment=a, worker_id=worker_id, tokens=tokens, finish_reason=reason))


def offers(fx: list[Effect]) -> list[SendOffer]:
    return [e for e in fx if isinstance(e, SendOffer)]


def cancels(fx: list[Effect]) -> list[SendCancel]:
    return [e for e in fx if isinstance(e, SendCancel)]
