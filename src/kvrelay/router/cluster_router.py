"""The asyncio interpreter of the pure router: real timers and a delivery callback per consumer.

All router steps run on one event loop, one at a time, so the router state
needs no lock. Effects are carried out in the order the router emitted them:
offers, cancels and fence notices go to ``send`` (the transport, or an in-process worker; when tracing, an
offer carries its attempt's span, ``telemetry.router_spans``),
timers become ``loop.call_at`` handles, deltas and results go to the
consumer's callbacks, records go to ``record`` (the fact store's buffered
``submit``, which never blocks). After each step every observer in
``observers`` sees the event and its effects (read-only taps such as the status
page's ``dashboard.tap``; they must not feed the router). A callback or
observer that raises is logged and counted; it never breaks the router.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, assert_never

from kvrelay.core.router.events import (
    CancelTimer,
    ConsumerCancelled,
    DeliverDelta,
    DeliverResult,
    DrainDeadline,
    DrainStarted,
    Effect,
    LoadReplicas,
    MessageReceived,
    Outcome,
    Record,
    Replica,
    ReplicasKnown,
    Request,
    RequestArrived,
    RouterEvent,
    SendCancel,
    SendFenced,
    SendOffer,
    StartTimer,
    Tick,
    TimerFired,
    TimerKey,
    WorkerUnavailable,
)
from kvrelay.core.router.machine import RouterState, step
from kvrelay.protocol.messages import WireMessage

if TYPE_CHECKING:
    from kvrelay.telemetry.router_spans import RouterSpans

log = logging.getLogger(__name__)

LATE_TICK_S = 1.0
"""How late a tick must be to be logged (``ClusterRouter._tick_forever``)."""

SendToWorker = Callable[[str, WireMessage], None]


class ReplicaSource(Protocol):
    """The fact store's live durable replicas (``facts.replica_map.ReplicaMap``)."""

    def of_tier(self, tier: str) -> tuple[Replica, ...]: ...

    def held_by(self, location: str) -> tuple[Replica, ...]: ...


@dataclass(frozen=True, slots=True)
class Consumer:
    """Where one request's stream goes: ``on_delta(index, tokens)`` then exactly one ``on_result``."""

    on_delta: Callable[[int, tuple[int, ...]], None]
    on_result: Callable[[Outcome], None]


class ClusterRouter:
    """Owns a ``RouterState`` on an event loop and interprets its effects."""

    def __init__(
        self,
        state: RouterState,
        send: SendToWorker,
        record: Callable[[Record], None] = lambda r: None,
        clock: Callable[[], float] = time.monotonic,
        tick_s: float = 0.5,
        replicas: ReplicaSource | None = None,
        spans: RouterSpans | None = None,
    ) -> None:
        """``spans``: start and end each request's spans from the router's steps (None: no tracing)."""
        self.state = state
        self._send = send
        self._record = record
        self._clock = clock
        self._tick_s = tick_s
        self._replicas = replicas
        """The fact store's durable replicas, read when the router starts and when a worker's epoch begins."""
        self._timers: dict[TimerKey, asyncio.TimerHandle] = {}
        self._consumers: dict[str, Consumer] = {}
        self._ticker: asyncio.Task[None] | None = None
        self._spans = spans
        self.callback_errors = 0
        self.observers: list[Callable[[RouterEvent, list[Effect]], None]] = []
        """Called with each event and its effects after the step, before the effects are carried out."""

    # --- inputs -------------------------------------------------------------

    def submit(self, request: Request, consumer: Consumer) -> None:
        """Route a new request; its deltas and its one outcome go to ``consumer``."""
        self._consumers[request.request_id] = consumer
        self.feed(RequestArrived(self._clock(), request))

    def cancel(self, request_id: str) -> None:
        self.feed(ConsumerCancelled(self._clock(), request_id))

    def receive(self, message: WireMessage) -> None:
        """A message from a worker (already decoded and bound to its connection by the transport)."""
        self.feed(MessageReceived(self._clock(), message))

    def worker_unavailable(self, worker_id: str, epoch: int) -> None:
        self.feed(WorkerUnavailable(self._clock(), worker_id, epoch))

    def start_drain(self) -> None:
        """Take no new request from now on (each ends at once with a ``shutting_down`` error)."""
        self.feed(DrainStarted(self._clock()))

    def end_drain(self) -> None:
        """End every request still in flight with a ``shutting_down`` error that says how far it got."""
        self.feed(DrainDeadline(self._clock()))

    @property
    def in_flight(self) -> int:
        """Requests the router holds (routed, running or waiting in the router queue), not yet ended."""
        return len(self.state.requests)

    def feed(self, event: RouterEvent) -> None:
        if self._spans is not None:
            start_ns = time.time_ns()
            self.state, effects = step(self.state, event)
            effects = self._guarded_spans(event, effects, start_ns)
        else:
            self.state, effects = step(self.state, event)
        for observe in self.observers:
            self._guard(observe, event, effects)
        for effect in effects:
            self._carry_out(effect)

    # --- lifecycle ----------------------------------------------------------

    def start(self) -> None:
        """Start the periodic tick that expires silent workers (call on the running loop)."""
        if self._ticker is None:
            self._ticker = asyncio.get_running_loop().create_task(self._tick_forever())
            self._learn(lambda source: source.of_tier("object"))

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            try:
                await self._ticker
            except asyncio.CancelledError:
                pass
            self._ticker = None
        for handle in self._timers.values():
            handle.cancel()
        self._timers.clear()

    async def _tick_forever(self) -> None:
        """Tick every ``tick_s``, with how late it is (``Tick.late_s``): the router's own process did not run
        meanwhile, so the workers' silence of that time is not theirs (a loop backlogged by token deltas on a
        starved 2-core machine ran ticks 1.7 and 2.6 s late and expired a worker heartbeating every 0.2 s). A
        tick later than ``LATE_TICK_S`` is also logged and counted (``late_ticks``)."""
        due = self._clock() + self._tick_s
        while True:
            await asyncio.sleep(max(0.0, due - self._clock()))
            now = self._clock()
            late = max(0.0, now - due)
            if late > LATE_TICK_S:
                self.state.count("late_ticks")
                log.warning("router: tick %.2f s late (its event loop or process did not run)", late)
            due = now + self._tick_s
            self.feed(Tick(now, late))

    # --- effects ------------------------------------------------------------

    def _carry_out(self, effect: Effect) -> None:
        match effect:
            case SendOffer(worker_id=wid, offer=offer):
                self._guard(self._send, wid, offer)
            case SendCancel(worker_id=wid, cancel=cancel):
                self._guard(self._send, wid, cancel)
            case SendFenced(worker_id=wid, fenced=fenced):
                self._guard(self._send, wid, fenced)
            case StartTimer(timer=key, at=at):
                old = self._timers.pop(key, None)
                if old is not None:
                    old.cancel()
                loop = asyncio.get_running_loop()
                delay = max(0.0, at - self._clock())
                self._timers[key] = loop.call_later(delay, self._fire, key)
            case CancelTimer(timer=key):
                handle = self._timers.pop(key, None)
                if handle is not None:
                    handle.cancel()
            case DeliverDelta(request_id=rid, index=index, tokens=tokens):
                consumer = self._consumers.get(rid)
                if consumer is not None:
                    self._guard(consumer.on_delta, index, tokens)
            case DeliverResult(request_id=rid, outcome=outcome):
                consumer = self._consumers.pop(rid, None)
                if consumer is not None:
                    self._guard(consumer.on_result, outcome)
            case Record():
                self._guard(self._record, effect)
            case LoadReplicas(worker_id=wid):
                self._learn(lambda source: source.held_by(wid))
            case _:
                assert_never(effect)

    def _guarded_spans(self, event: RouterEvent, effects: list[Effect], start_ns: int) -> list[Effect]:
        """The effects as ``RouterSpans.observe`` returns them; unchanged (and logged) if it fails."""
        assert self._spans is not None
        try:
            return self._spans.observe(event, effects, start_ns, time.time_ns())
        except Exception:
            self.callback_errors += 1
            log.exception("tracing the router's step failed; carrying out its effects untraced")
            return effects

    def _learn(self, read: Callable[[ReplicaSource], tuple[Replica, ...]]) -> None:
        if self._replicas is None:
            return
        try:
            replicas = read(self._replicas)
        except Exception:
            log.exception("reading replica facts failed; routing on the residency index alone")
            return
        if replicas:
            self.feed(ReplicasKnown(self._clock(), replicas))

    def _fire(self, key: TimerKey) -> None:
        self._timers.pop(key, None)
        self.feed(TimerFired(self._clock(), key))

    def _guard(self, fn: Callable[..., object], *args: object) -> None:
        try:
            fn(*args)
        except Exception:
            self.callback_errors += 1
            log.exception("effect callback %s failed", getattr(fn, "__qualname__", fn))
