"""The deterministic simulator: logical time driving the real router and worker machines.

One heap of timed events (ties broken by insertion order) feeds ``router.step``
and the simulated workers (``sim.workers``, which run ``core.worker.machine.step``); every
router effect is carried out here: offers and cancels go through the seeded
``NetworkModel``, timers become heap events, deliveries reach the consumer
records. No routing or protocol rule lives here.

Faults: directed partitions and per-link loss (``network``), worker crashes with
an optional restart (a new epoch; the transport reports the lost connection as
``WorkerUnavailable`` after ``detect_s``), consumer cancellations.

The consumers (``sim.consumers``) check, independently of the router, what every
delivery must satisfy; what they find is in ``violations``.

With ``log=True`` every input and effect is written to a text log; the same
seed and input give a byte-identical log.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import assert_never

from kvrelay.core.policies.base import Policy
from kvrelay.core.router.events import (
    CancelTimer,
    ConsumerCancelled,
    DeliverDelta,
    DeliverResult,
    Effect,
    LoadReplicas,
    MessageReceived,
    Record,
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
from kvrelay.core.router.machine import RouterConfig, new_router, step
from kvrelay.core.worker import events as worker_events
from kvrelay.protocol.messages import (
    Assignment,
    Cancel,
    Delta,
    Fenced,
    Offer,
    Result,
    RouteSegment,
    WireMessage,
)
from kvrelay.sim.cache import SharedObjectTier, WorkerCaches
from kvrelay.sim.chunk_origins import ChunkOrigins
from kvrelay.sim.cluster_config import ClusterConfig
from kvrelay.sim.consumers import SimConsumer, receive_delta, receive_outcome
from kvrelay.sim.events import (
    Arrival,
    ConnectionLost,
    ConsumerCancel,
    Crash,
    HeartbeatDue,
    Restart,
    RouterTick,
    SimEvent,
    TimerDue,
    ToRouter,
    ToWorker,
    WorkerDue,
    WorkerScheduled,
)
from kvrelay.sim.log import describe
from kvrelay.sim.network import ROUTER, NetworkModel
from kvrelay.sim.workers import SimWorker


@dataclass(frozen=True, slots=True)
class OfferSent:
    """An offer the router sent (its prompt is not kept)."""

    at: float
    worker_id: str
    epoch: int
    assignment: Assignment
    route: tuple[RouteSegment, ...]
    prompt_tokens: int
    generated_before: int
    priority: float


class Simulation:
    """A cluster of simulated workers behind one router, under logical time."""

    def __init__(
        self,
        cluster: ClusterConfig,
        *,
        router_config: RouterConfig | None = None,
        policy: str | Policy = "kvrelay",
        seed: int = 0,
        log: bool = True,
        delta_tokens: int = 1,
        tick_s: float = 0.25,
        detect_s: float | None = 0.05,
        admission_s: float = 0.0,
        rematch: bool = True,
    ) -> None:
        """``policy``: a policy name or instance; ``rematch``: workers re-match a prefix when its prefill starts."""
        self.cluster = cluster
        config = router_config or RouterConfig(chunk_tokens=cluster.chunk_tokens)
        if config.chunk_tokens != cluster.chunk_tokens:
            raise ValueError(
                f"router chunk_tokens {config.chunk_tokens} != cluster chunk_tokens {cluster.chunk_tokens}"
            )
        fps = {**dict(config.model_fingerprints), cluster.model: cluster.fingerprint}
        self.router = new_router(replace(config, model_fingerprints=fps), policy, seed)
        self.network = NetworkModel(cluster.network, seed)
        self.detect_s, self.tick_s = detect_s, tick_s
        self.now = 0.0
        self._heap: list[tuple[float, int, SimEvent]] = []
        self._seq = 0
        self._timers: dict[TimerKey, int] = {}
        self.log: list[str] | None = [] if log else None
        self.consumers: dict[str, SimConsumer] = {}
        self.offers: list[OfferSent] = []
        self.current: dict[str, Assignment] = {}
        self.cancelled: set[Assignment] = set()
        self.violations: list[str] = []
        self.records: dict[str, int] = {}
        self._open = 0
        self._to_workers = 0
        self.known_chains: dict[str, tuple[bytes, ...]] = {}
        self.shared = SharedObjectTier()
        self.origins = ChunkOrigins(cluster.chunk_tokens)
        self.peers: dict[str, WorkerCaches] = {}
        self.workers: dict[str, SimWorker] = {}
        for i in range(cluster.workers):
            wid = f"w{i}"
            self.workers[wid] = SimWorker(
                wid,
                cluster,
                self.shared,
                self.peers,
                self._schedule_worker,
                self._send_to_router,
                delta_tokens,
                self.known_chains,
                admission_s,
                rematch,
                cluster.spec_of(i),
                self.origins,
            )
            self._start_worker(wid, 0.0, offset=cluster.heartbeat_interval_s * i / cluster.workers)
        self._push(0.0, RouterTick())

    # --- the heap ----------------------------------------------------------------

    def _push(self, at: float, event: SimEvent) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (at, self._seq, event))

    def _note(self, text: str) -> None:
        if self.log is not None:
            self.log.append(f"{self.now:.6f} {text}")

    def log_bytes(self) -> bytes:
        return ("\n".join(self.log or []) + "\n").encode()

    # --- inputs --------------------------------------------------------------------

    def submit(self, request: Request, at: float) -> None:
        """Submit ``request`` at logical time ``at``."""
        self.submit_later(request.request_id, at, lambda: request)

    def submit_later(self, request_id: str, at: float, make: Callable[[], Request]) -> None:
        """Submit the request ``make()`` builds at time ``at`` (built only then, to bound memory)."""
        self.consumers[request_id] = SimConsumer(request_id, at)
        self._open += 1
        self._push(at, Arrival(make))

    def cancel(self, request_id: str, at: float) -> None:
        self._push(at, ConsumerCancel(request_id))

    def crash(self, worker_id: str, at: float, restart_after: float | None = None) -> None:
        self._push(at, Crash(worker_id, restart_after))

    def partition(self, src: str, dst: str, start: float, end: float = math.inf) -> None:
        """Drop messages from ``src`` to ``dst`` (``"router"`` or a worker id) sent in ``[start, end)``."""
        self.network.partition(src, dst, start, end)

    # --- running -------------------------------------------------------------------

    def quiescent(self) -> bool:
        """Every request has its outcome, nothing is on its way to a worker, no worker holds a reservation."""
        return (
            self._open == 0 and self._to_workers == 0 and not any(w.holds_reservations() for w in self.workers.values())
        )

    def run(self, until: float = math.inf) -> bool:
        """Process events until quiescent (True) or until logical time ``until`` (False)."""
        while self._heap:
            if self._open == 0 and self.quiescent():
                return True
            if self._heap[0][0] > until:
                return False
            at, _, event = heapq.heappop(self._heap)
            self.now = at
            self._handle(event)
        return self.quiescent()

    def _handle(self, event: SimEvent) -> None:
        match event:
            case Arrival(make=make):
                self._on_arrive(make)
            case ConsumerCancel(request_id=request_id):
                self._router(ConsumerCancelled(self.now, request_id))
            case RouterTick():
                self._router(Tick(self.now))
                self._push(self.now + self.tick_s, event)
            case TimerDue(timer=timer):
                self._on_timer(timer)
            case ToRouter(message=message):
                self._on_to_router(message)
            case ToWorker(worker_id=worker_id, message=message):
                self._on_to_worker(worker_id, message)
            case WorkerScheduled(worker_id=worker_id, incarnation=incarnation, event=due):
                w = self.workers[worker_id]
                if w.alive and w.incarnation == incarnation:
                    w.on_due(self.now, due)
            case HeartbeatDue():
                self._on_heartbeat(event)
            case Crash(worker_id=worker_id, restart_after=restart_after):
                self._on_crash(worker_id, restart_after)
            case ConnectionLost(worker_id=worker_id, epoch=epoch):
                self._router(WorkerUnavailable(self.now, worker_id, epoch))
            case Restart(worker_id=worker_id):
                if not self.workers[worker_id].alive:
                    self._start_worker(worker_id, self.now)
            case _:
                assert_never(event)

    def _router(self, event: RouterEvent, cause: Assignment | None = None) -> None:
        if self.log is not None:
            self._note(f"router <- {describe(event)}")
        self.router, effects = step(self.router, event)
        for effect in effects:
            self._carry(effect, cause)

    def _carry(self, effect: Effect, cause: Assignment | None) -> None:
        if self.log is not None and not isinstance(effect, (LoadReplicas, Record)):
            self._note(f"router -> {describe(effect)}")
        match effect:
            case SendOffer(worker_id=worker_id, offer=o):
                self.current[o.assignment.request_id] = o.assignment
                self.offers.append(
                    OfferSent(
                        self.now,
                        worker_id,
                        o.epoch,
                        o.assignment,
                        o.route,
                        len(o.prompt),
                        o.generated_before,
                        o.priority,
                    )
                )
                self._send_to_worker(worker_id, o)
            case SendCancel(worker_id=worker_id, cancel=cancel):
                self.cancelled.add(cancel.assignment)
                self._send_to_worker(worker_id, cancel)
            case SendFenced(worker_id=worker_id, fenced=fenced):
                self._send_to_worker(worker_id, fenced)
            case StartTimer(timer=timer, at=at):
                self._push(at, TimerDue(timer))
                self._timers[timer] = self._seq
            case CancelTimer(timer=timer):
                self._timers.pop(timer, None)
            case DeliverDelta(request_id=rid):
                live = cause is not None and cause == self.current.get(rid) and cause not in self.cancelled
                self.violations += receive_delta(self.consumers[rid], effect, cause, live, self.now)
            case DeliverResult(outcome=outcome):
                consumer = self.consumers[outcome.request_id]
                self.violations += receive_outcome(consumer, outcome)
                if len(consumer.outcomes) == 1:
                    self._open -= 1
                    self.known_chains.pop(outcome.request_id, None)
            case Record(kind=kind):
                self.records[kind] = self.records.get(kind, 0) + 1
            case LoadReplicas():
                pass  # the simulated cluster has no fact store; its index follows residency events alone
            case _:
                assert_never(effect)

    def _send_to_worker(self, worker_id: str, message: Offer | Cancel | Fenced) -> None:
        arrival = self.network.transit(ROUTER, worker_id, self.now)
        if arrival is None:
            self._note(f"lost router -> {worker_id}: {describe(message)}")
            return
        self._to_workers += 1
        self._push(arrival, ToWorker(worker_id, message))

    def _send_to_router(self, now: float, worker_id: str, message: WireMessage) -> None:
        arrival = self.network.transit(worker_id, ROUTER, now)
        if arrival is None:
            self._note(f"lost {worker_id} -> router: {describe(message)}")
            return
        self._push(arrival, ToRouter(message))

    def _schedule_worker(self, at: float, worker_id: str, incarnation: int, event: WorkerDue) -> None:
        self._push(at, WorkerScheduled(worker_id, incarnation, event))

    def _start_worker(self, worker_id: str, at: float, offset: float = 0.0) -> None:
        w = self.workers[worker_id]
        w.start(at)
        self._note(f"start {worker_id} epoch {w.epoch}")
        self._push(at + offset, HeartbeatDue(worker_id, w.incarnation))

    # --- event handlers ------------------------------------------------------------------

    def _on_arrive(self, make: Callable[[], Request]) -> None:
        request = make()
        c = self.consumers[request.request_id]
        c.prompt_tokens, c.seed = len(request.prompt), request.sampling.seed
        if request.chain is not None:
            self.known_chains[request.request_id] = request.chain
        self._router(RequestArrived(self.now, request))

    def _on_timer(self, timer: TimerKey) -> None:
        if self._timers.get(timer) is None:
            return
        del self._timers[timer]
        self._router(TimerFired(self.now, timer))

    def _on_to_router(self, message: WireMessage) -> None:
        cause = message.assignment if isinstance(message, (Delta, Result)) else None
        self._router(MessageReceived(self.now, message), cause)

    def _on_to_worker(self, worker_id: str, message: Offer | Cancel | Fenced) -> None:
        self._to_workers -= 1
        w = self.workers[worker_id]
        if not w.alive:
            self._note(f"dropped at dead {worker_id}: {describe(message)}")
            return
        self._note(f"{worker_id} <- {describe(message)}")
        event: worker_events.WorkerEvent
        match message:
            case Offer():
                event = worker_events.OfferReceived(self.now, message)
            case Cancel():
                event = worker_events.CancelReceived(self.now, message)
            case Fenced():
                w.on_fenced(self.now, message)
                return
            case _:
                assert_never(message)
        w.deliver(self.now, event)

    def _on_heartbeat(self, due: HeartbeatDue) -> None:
        w = self.workers[due.worker_id]
        if not (w.alive and w.incarnation == due.incarnation):
            return
        self._send_to_router(self.now, due.worker_id, w.heartbeat(self.now))
        w.flush_residency(self.now)
        self._push(self.now + self.cluster.heartbeat_interval_s, due)

    def _on_crash(self, worker_id: str, restart_after: float | None) -> None:
        w = self.workers[worker_id]
        if not w.alive:
            return
        self._note(f"crash {worker_id} epoch {w.epoch}")
        w.crash()
        if self.detect_s is not None:
            self._push(self.now + self.detect_s, ConnectionLost(worker_id, w.epoch))
        if restart_after is not None:
            self._push(self.now + restart_after, Restart(worker_id))
