"""The router queue: requests no worker can start within a bound wait here, in priority classes, fair across users.

Rules (docs/design.md section 6, "Router queue"); pure, so the simulator and the
live router run them alike:

- Order. Lower ``priority`` first (vLLM's convention); a class is served only
  while every class before it is empty. Within a class, users (the OpenAI
  ``user`` field; requests without one share the flow ``""``) are served by
  start-time fair queuing (Goyal, Vin and Cheng, SIGCOMM 1996) over predicted
  work: the flow whose start tag ``max(class virtual time, flow finish tag)`` is
  lowest goes next (ties: the flow whose next request came first), its finish
  tag grows by that request's work and the class's virtual time becomes the
  start tag. A user who sends much gets the same share of service as one who
  sends little while both wait. Within a user's flow, requests go by the
  policy's ``hold_order`` keys (``HoldOrder``; arrival for FIFO), then arrival:
  its ``usual`` key, or its ``long_backlog`` key while the router has set
  ``long_backlog`` (``router.offered_load``). Each request is kept under both,
  so the switch reorders every waiting request at once.
- Head of line. Only the head may leave, so a request that needs more room than
  is free now is never passed by smaller ones and never starves.
- Bounds, at arrival only. A new request is refused (``Refusal``; a 429 with
  ``Retry-After`` at the API) when ``max_requests`` are waiting, or when the
  predicted work of its class and the classes before it, spread over the live
  workers, exceeds ``max_wait_s``. A request once admitted is never refused:
  one that comes back (its offer was declined, its worker was lost) goes to
  the front of its flow.

Nothing here knows workers or time: the router (``router.attempts``) decides
when a request must wait (no worker can start it within ``Limits.start_within_s``)
and tells the queue the predicted work and the number of live workers.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

__all__ = ["QUEUE_OFF", "HoldOrder", "Limits", "Refusal", "RouterQueue"]

MIN_CHARGE_S = 1e-3
"""The least work a request is charged in fair queuing, so fully cached requests still take turns."""


@dataclass(frozen=True, slots=True)
class Limits:
    """When requests wait at the router, and how many may."""

    start_within_s: float = 2.0
    """A request waits at the router while no worker it could go to has a queue shorter than this; inf: never."""
    max_requests: int = 4096
    """At most this many requests wait; a new one beyond is refused."""
    max_wait_s: float = 120.0
    """A new request is refused when the predicted work ahead of it, per live worker, exceeds this. Two
    minutes: the prediction comes from heartbeats measured under the load it predicts, so a tighter default
    refused 32 concurrent 256-token streams on one loaded CPU worker (a 31 s prediction against 30 s)."""

    def __post_init__(self) -> None:
        if not self.start_within_s >= 0.0:
            raise ValueError(f"the queue's start bound must be at least 0 s, got {self.start_within_s}")
        if self.max_requests < 1:
            raise ValueError(f"the queue must hold at least 1 request, got {self.max_requests}")
        if not self.max_wait_s >= 0.0:
            raise ValueError(f"the queue's wait bound must be at least 0 s, got {self.max_wait_s}")


QUEUE_OFF = Limits(start_within_s=math.inf, max_requests=2**62, max_wait_s=math.inf)
"""No router queue: every request goes to a worker's queue as soon as one has room for it."""


class HoldOrder(NamedTuple):
    """A waiting request's keys, lower first: usually, and while a long backlog waits on a cluster that is not
    overloaded (``router.offered_load.long_backlog``)."""

    usual: float
    long_backlog: float

    @classmethod
    def of(cls, key: float) -> HoldOrder:
        """One key for both."""
        return cls(key, key)


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a new request was not admitted, and when to try again (seconds, at least 1)."""

    reason: str
    retry_after_s: int


@dataclass(slots=True)
class _Held:
    request_id: str
    priority: int
    user: str
    work_s: float
    seq: int


@dataclass(slots=True)
class _Flow:
    heaps: tuple[list[tuple[float, int, str]], list[tuple[float, int, str]]] = field(default_factory=lambda: ([], []))
    """``(order key, seq, request id)`` by the usual and by the long-backlog key; entries whose request left are
    skipped when met."""
    finish: float = 0.0
    """Finish tag: the start tag of its last served request plus that request's work."""


@dataclass(slots=True)
class _Class:
    flows: dict[str, _Flow] = field(default_factory=dict)
    virtual: float = 0.0
    count: int = 0
    work_s: float = 0.0


class RouterQueue:
    """Requests waiting at the router (see the module docstring for the rules)."""

    def __init__(self) -> None:
        self._held: dict[str, _Held] = {}
        self._classes: dict[int, _Class] = {}
        self._seq = 0
        self.work_s = 0.0
        """Predicted work of every waiting request (seconds)."""
        self.long_backlog = False
        """Serve by the requests' ``HoldOrder.long_backlog`` keys (set by the router)."""

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._held

    def __iter__(self) -> Iterator[str]:
        """The waiting requests' ids, in the order they came."""
        return iter(self._held)

    def work_ahead(self, priority: int) -> float:
        """Predicted work of the waiting requests of class ``priority`` and the classes before it."""
        return sum(c.work_s for p, c in self._classes.items() if p <= priority)

    def admit(
        self,
        limits: Limits,
        request_id: str,
        priority: int,
        user: str,
        work_s: float,
        order: HoldOrder,
        workers: int,
    ) -> Refusal | None:
        """Queue a new request unless a bound refuses it; ``workers``: the live workers its work spreads over."""
        per_worker = max(1, workers)
        if len(self._held) >= limits.max_requests:
            mean = self.work_s / len(self._held) / per_worker
            return Refusal(f"{len(self._held)} requests are waiting, the most the router queue holds", _secs(mean))
        wait = self.work_ahead(priority) / per_worker
        if wait > limits.max_wait_s:
            return Refusal(
                f"the work waiting ahead of it would take {wait:.1f} s, over the queue's bound of "
                f"{limits.max_wait_s:g} s",
                _secs(wait - limits.max_wait_s),
            )
        self._push(request_id, priority, user, work_s, order)
        return None

    def requeue(self, request_id: str, priority: int, user: str, work_s: float) -> None:
        """Queue an admitted request that came back, at the front of its flow, whatever the bounds."""
        self._push(request_id, priority, user, work_s, HoldOrder.of(-math.inf))

    def _push(self, request_id: str, priority: int, user: str, work_s: float, order: HoldOrder) -> None:
        if request_id in self._held:
            raise ValueError(f"request '{request_id}' is already waiting in the router queue")
        self._seq += 1
        held = self._held[request_id] = _Held(request_id, priority, user, max(0.0, work_s), self._seq)
        klass = self._classes.setdefault(priority, _Class())
        flow = klass.flows.setdefault(user, _Flow())
        for heap, key in zip(flow.heaps, order, strict=True):
            if len(heap) > 2 * len(self._held) + 64:  # the heap not read keeps entries of requests that left
                heap[:] = [e for e in heap if (h := self._held.get(e[2])) is not None and h.seq == e[1]]
                heapq.heapify(heap)
            heapq.heappush(heap, (key, held.seq, request_id))
        klass.count += 1
        klass.work_s += held.work_s
        self.work_s += held.work_s

    def head(self) -> str | None:
        """The request that leaves next, or None when none waits."""
        chosen = self._next()
        return None if chosen is None else chosen[2]

    def _next(self) -> tuple[_Class, _Flow, str] | None:
        if not self._held:
            return None
        priority = min(p for p, c in self._classes.items() if c.count)
        klass = self._classes[priority]
        best: tuple[float, int] | None = None
        chosen: tuple[_Flow, str] | None = None
        idle: list[str] = []
        for user, flow in klass.flows.items():
            top = self._top(flow)
            if top is None:
                if flow.finish <= klass.virtual:  # its start tag would be the virtual time anyway
                    idle.append(user)
                continue
            key = (max(klass.virtual, flow.finish), top[1])
            if best is None or key < best:
                best, chosen = key, (flow, top[2])
        for user in idle:
            del klass.flows[user]
        assert chosen is not None, "a class with waiting requests has a flow with one"
        return klass, chosen[0], chosen[1]

    def _top(self, flow: _Flow) -> tuple[float, int, str] | None:
        heap = flow.heaps[self.long_backlog]
        while heap:
            _, seq, rid = top = heap[0]
            held = self._held.get(rid)
            if held is not None and held.seq == seq:
                return top
            heapq.heappop(heap)
        return None

    def take(self, request_id: str) -> None:
        """The head left for a worker: charge its flow its work and advance the class's virtual time."""
        chosen = self._next()
        if chosen is None or chosen[2] != request_id:
            raise ValueError(f"request '{request_id}' is not the head of the router queue")
        klass, flow, _ = chosen
        start = max(klass.virtual, flow.finish)
        flow.finish = start + max(self._held[request_id].work_s, MIN_CHARGE_S)
        klass.virtual = start
        self.remove(request_id)

    def remove(self, request_id: str) -> None:
        """Withdraw a waiting request (it ended, was cancelled or left); no-op when it is not waiting."""
        held = self._held.pop(request_id, None)
        if held is None:
            return
        klass = self._classes[held.priority]
        klass.count -= 1
        klass.work_s -= held.work_s
        self.work_s -= held.work_s
        if not klass.count:  # exact zeros again, so sums over emptied classes stay exact
            klass.work_s = 0.0
            klass.flows = {u: _Flow(finish=f.finish) for u, f in klass.flows.items() if f.finish > klass.virtual}
        if not self._held:
            self.work_s = 0.0


def _secs(seconds: float) -> int:
    """A ``Retry-After`` value: whole seconds, at least 1."""
    return max(1, math.ceil(seconds)) if math.isfinite(seconds) else 3600
