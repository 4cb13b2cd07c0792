"""The worker machine's events (what happened to it) and effects (what it asks its interpreter to do).

``core.worker.machine.step`` takes one ``WorkerEvent`` and returns ``WorkerEffect`` values; the life of an
assignment through them is in that module's docstring.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvrelay.protocol.messages import (
    Assignment,
    Cancel,
    DeclineReason,
    Delta,
    FinishReason,
    Offer,
    OfferResult,
    Result,
    Timings,
    Usage,
)


@dataclass(frozen=True, slots=True)
class OfferReceived:
    now: float
    offer: Offer


@dataclass(frozen=True, slots=True)
class AdmissionDecided:
    """The injected admission's answer to ``RequestAdmission``; ``reason`` is set when declined."""

    now: float
    assignment: Assignment
    accepted: bool
    reason: DeclineReason | None = None
    detail: str = ""


@dataclass(frozen=True, slots=True)
class CancelReceived:
    now: float
    cancel: Cancel


@dataclass(frozen=True, slots=True)
class TokensProduced:
    """The runtime produced the next ``tokens`` of a running assignment, in order."""

    now: float
    assignment: Assignment
    tokens: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class WorkFinished:
    """The runtime finished an assignment (all its tokens were reported before)."""

    now: float
    assignment: Assignment
    finish_reason: FinishReason
    usage: Usage = Usage()
    timings: Timings = Timings()
    error: str | None = None


@dataclass(frozen=True, slots=True)
class WorkQuiesced:
    """After ``FenceWork``: no operation of the assignment is in flight any more."""

    now: float
    assignment: Assignment


@dataclass(frozen=True, slots=True)
class ShutdownRequested:
    """From now on every offer is declined with ``shutting_down``; running work continues."""

    now: float


@dataclass(frozen=True, slots=True)
class EpochEnded:
    """The router fenced the current epoch (it said so, or the connection carrying it was lost): every
    assignment is fenced as a cancel would, and the worker continues in ``epoch``, which must be newer."""

    now: float
    epoch: int


WorkerEvent = (
    OfferReceived
    | AdmissionDecided
    | CancelReceived
    | TokensProduced
    | WorkFinished
    | WorkQuiesced
    | ShutdownRequested
    | EpochEnded
)


@dataclass(frozen=True, slots=True)
class RequestAdmission:
    """Ask the injected admission to reserve pages for ``offer`` (answer: ``AdmissionDecided``)."""

    offer: Offer


@dataclass(frozen=True, slots=True)
class StartWork:
    """Run restore, prefill and decode for ``offer``; its reservation is held."""

    offer: Offer


@dataclass(frozen=True, slots=True)
class FenceWork:
    """Stop ``assignment`` now; answer ``WorkQuiesced`` once nothing of it is in flight."""

    assignment: Assignment


@dataclass(frozen=True, slots=True)
class ReleaseReservation:
    """Give back every page reserved for ``assignment`` (filled prefix pages may stay as cache)."""

    assignment: Assignment


@dataclass(frozen=True, slots=True)
class SendMessage:
    """Send a wire message about one assignment to the router."""

    message: OfferResult | Delta | Result


WorkerEffect = RequestAdmission | StartWork | FenceWork | ReleaseReservation | SendMessage
