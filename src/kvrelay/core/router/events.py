"""Events into and effects out of the pure router machine (docs/design.md section 2).

Time arrives inside events (``now``, seconds on the interpreter's clock); the
router reads no clock. Effects are plain data that an interpreter (``sim``,
``cluster``, ``transport``) carries out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from kvrelay.protocol.messages import (
    Cancel,
    Fenced,
    FinishReason,
    Offer,
    Sampling,
    Usage,
    WireMessage,
)


class ErrorKind(StrEnum):
    """Why the router ended a request with an error (the value is the metric label and the text's prefix)."""

    NO_WORKER = "no_worker"
    OVER_CONTEXT_LIMIT = "over_context_limit"
    NO_CAPACITY = "no_capacity"
    """The request needs more KV than any worker serving its model holds even when idle."""
    QUEUE_FULL = "queue_full"
    """Refused at arrival: the router queue was at a bound (``queue.Limits``); ``retry_after_s`` says when to retry."""
    GAVE_UP = "gave_up"
    DUPLICATE_REQUEST = "duplicate_request"
    SHUTTING_DOWN = "shutting_down"
    """The router is draining (it takes no new request) or its drain ran out of time mid-request."""


@dataclass(frozen=True, slots=True)
class RequestError:
    """A request's terminal error: its ``kind`` and the human ``detail``.

    ``text`` is what decision records, logs and clients see: ``"<kind>: <detail>"`` for the kinds a
    client must tell apart (no worker, over the context limit, no capacity); the detail alone for the
    others (``"gave up after N attempts: ..."``).
    """

    kind: ErrorKind
    detail: str
    retry_after_s: int | None = None
    """Whole seconds after which the same request may succeed (``QUEUE_FULL`` sets it)."""

    @property
    def text(self) -> str:
        return f"{self.kind}: {self.detail}" if self.kind in _PREFIXED else self.detail


_PREFIXED = frozenset({ErrorKind.NO_WORKER, ErrorKind.OVER_CONTEXT_LIMIT, ErrorKind.NO_CAPACITY, ErrorKind.QUEUE_FULL})


@dataclass(frozen=True, slots=True)
class Request:
    """A request as ingress submits it.

    ``chain`` may carry precomputed chunk keys (a trace replay knows them from
    its block ids); otherwise the router derives them from ``prompt``.
    ``traceparent`` (W3C; ``""``: none) is the ingress's span of the request; every offer carries it on
    (the live router's shell puts its own span of the attempt there when it traces).
    ``priority`` (lower first) and ``user`` order it in the router queue
    (``router.queue``) when it has to wait there.
    """

    request_id: str
    model: str
    prompt: tuple[int, ...]
    max_new_tokens: int
    sampling: Sampling = Sampling()
    chain: tuple[bytes, ...] | None = None
    traceparent: str = ""
    priority: int = 0
    user: str = ""


class TimerKind(StrEnum):
    OFFER = "offer"
    """The offer timeout, then (once accepted) the progress timeout of one attempt."""


TimerKey = tuple[TimerKind, str, int]
"""``(kind, request_id, attempt)``."""


Replica = tuple[bytes, str, str]
"""``(chunk key, tier, location)`` of a durable replica fact: location is a worker id or a bucket."""


@dataclass(frozen=True, slots=True)
class RequestArrived:
    """A new request."""

    now: float
    request: Request


@dataclass(frozen=True, slots=True)
class ReplicasKnown:
    """Durable replica facts the shell read from the fact store: every object replica at start, and a
    worker's own replicas when ``LoadReplicas`` asked for them (its epoch began)."""

    now: float
    replicas: tuple[Replica, ...]


@dataclass(frozen=True, slots=True)
class MessageReceived:
    """A wire message from a worker (offer result, delta, result, heartbeat, residency)."""

    now: float
    message: WireMessage


@dataclass(frozen=True, slots=True)
class TimerFired:
    now: float
    timer: TimerKey


@dataclass(frozen=True, slots=True)
class WorkerUnavailable:
    """The transport lost the worker's connection, or it crashed, in ``epoch``."""

    now: float
    worker_id: str
    epoch: int


@dataclass(frozen=True, slots=True)
class ConsumerCancelled:
    now: float
    request_id: str


@dataclass(frozen=True, slots=True)
class Tick:
    """Periodic clock event: lets the router expire silent workers. ``late_s``: how much later than due the
    router's own process delivered it; the workers are not blamed for that silence (``registry.credit_pause``)."""

    now: float
    late_s: float = 0.0


@dataclass(frozen=True, slots=True)
class DrainStarted:
    """The router is shutting down: every new request ends at once (``shutting_down``); running ones go on."""

    now: float


@dataclass(frozen=True, slots=True)
class DrainDeadline:
    """The drain's time is up: every request still in flight ends with a ``shutting_down`` error (its worker
    is sent a cancel), so its consumer learns why it stopped."""

    now: float


RouterEvent = (
    RequestArrived
    | ReplicasKnown
    | MessageReceived
    | TimerFired
    | WorkerUnavailable
    | ConsumerCancelled
    | Tick
    | DrainStarted
    | DrainDeadline
)


@dataclass(frozen=True, slots=True)
class SendOffer:
    worker_id: str
    offer: Offer


@dataclass(frozen=True, slots=True)
class SendCancel:
    worker_id: str
    cancel: Cancel


@dataclass(frozen=True, slots=True)
class SendFenced:
    """Tell ``worker_id`` that the epoch its heartbeat carried is fenced, so it comes back in a newer one."""

    worker_id: str
    fenced: Fenced


@dataclass(frozen=True, slots=True)
class StartTimer:
    timer: TimerKey
    at: float


@dataclass(frozen=True, slots=True)
class CancelTimer:
    timer: TimerKey


@dataclass(frozen=True, slots=True)
class DeliverDelta:
    """Tokens for the consumer; ``index`` is the stream position of ``tokens[0]``."""

    request_id: str
    index: int
    tokens: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Outcome:
    """The one terminal outcome a consumer receives.

    ``tokens`` is the whole delivered stream across attempts; ``usage`` sums
    the attempts' accounting.
    """

    request_id: str
    finish_reason: FinishReason
    tokens: tuple[int, ...]
    attempts: int
    usage: Usage = Usage()
    ttft_s: float | None = None
    failure: RequestError | None = None

    @property
    def error(self) -> str | None:
        """The failure's text, or None when the request did not fail."""
        return None if self.failure is None else self.failure.text


@dataclass(frozen=True, slots=True)
class DeliverResult:
    request_id: str
    outcome: Outcome


class RecordKind(StrEnum):
    """What a ``Record`` holds; the value names it in the fact store."""

    DECISION = "decision"
    OFFER_OUTCOME = "offer_outcome"
    OUTCOME = "outcome"
    REPLICA = "replica"
    """A durable tier's residency change (the fact store's replica facts)."""


class OfferOutcome(StrEnum):
    """How one offer ended, as an ``offer_outcome`` record stores it."""

    ACCEPTED = "accepted"
    DECLINED = "declined"
    TIMED_OUT = "timed_out"
    WORKER_LOST = "worker_lost"
    CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class Record:
    """A decision-grade fact for the fact store (never high-rate samples)."""

    kind: RecordKind
    request_id: str
    attempt: int
    now: float
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class LoadReplicas:
    """Read the fact store's durable replicas held by ``worker_id`` and feed them back as ``ReplicasKnown``."""

    worker_id: str


Effect = (
    SendOffer
    | SendCancel
    | SendFenced
    | StartTimer
    | CancelTimer
    | DeliverDelta
    | DeliverResult
    | Record
    | LoadReplicas
)
