"""The simulator's own timed events: what its heap holds (``SimEvent``) and what a simulated worker schedules
for itself (``WorkerDue``).

Plain frozen data; ``sim.interpreter`` and ``sim.workers`` dispatch on their types.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvrelay.core.router.events import Request, TimerKey
from kvrelay.protocol.messages import Assignment, Cancel, Fenced, Offer, WireMessage

if TYPE_CHECKING:
    from kvrelay.sim.work import Work


@dataclass(frozen=True, slots=True)
class AdmissionDue:
    """A delayed admission decision (``admission_s`` after the offer arrived)."""

    offer: Offer


@dataclass(frozen=True, slots=True)
class RestoreDone:
    """The restore of an accepted assignment's non-gpu prefix finished."""

    assignment: Assignment


@dataclass(frozen=True, slots=True)
class IterationDone:
    """The device iteration that ran ``decode`` (one token each) and ``prefill`` (work, tokens) finished."""

    decode: list[Work]
    prefill: list[tuple[Work, int]]


WorkerDue = AdmissionDue | RestoreDone | IterationDone
"""What a simulated worker schedules for itself."""


@dataclass(frozen=True, slots=True)
class Arrival:
    """A request arrives; ``make`` builds it only then (to bound memory)."""

    make: Callable[[], Request]


@dataclass(frozen=True, slots=True)
class ConsumerCancel:
    request_id: str


@dataclass(frozen=True, slots=True)
class RouterTick:
    """The router's periodic tick."""


@dataclass(frozen=True, slots=True)
class TimerDue:
    """A router timer's time came (it fires unless cancelled since)."""

    timer: TimerKey


@dataclass(frozen=True, slots=True)
class ToRouter:
    """A wire message from a worker reaches the router."""

    message: WireMessage


@dataclass(frozen=True, slots=True)
class ToWorker:
    """An offer, cancel or fence notice from the router reaches a worker."""

    worker_id: str
    message: Offer | Cancel | Fenced


@dataclass(frozen=True, slots=True)
class WorkerScheduled:
    """An event a worker scheduled for itself in its ``incarnation`` (dropped if that process ended)."""

    worker_id: str
    incarnation: int
    event: WorkerDue


@dataclass(frozen=True, slots=True)
class HeartbeatDue:
    """A worker's next heartbeat in its ``incarnation`` (the heartbeat carries whatever epoch is current)."""

    worker_id: str
    incarnation: int


@dataclass(frozen=True, slots=True)
class Crash:
    """The worker process dies; it starts again (a new epoch) ``restart_after`` seconds later if given."""

    worker_id: str
    restart_after: float | None


@dataclass(frozen=True, slots=True)
class ConnectionLost:
    """The transport reports the crashed worker's connection lost (``WorkerUnavailable``)."""

    worker_id: str
    epoch: int


@dataclass(frozen=True, slots=True)
class Restart:
    worker_id: str


SimEvent = (
    Arrival
    | ConsumerCancel
    | RouterTick
    | TimerDue
    | ToRouter
    | ToWorker
    | WorkerScheduled
    | HeartbeatDue
    | Crash
    | ConnectionLost
    | Restart
)
