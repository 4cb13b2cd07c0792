"""What the status page knows: a read-only tap on the live router's steps.

Contract:
- ``ClusterTap.observe(event, effects)`` is a ``ClusterRouter`` observer: it
  reads each event and the effects the pure router emitted for it, and never
  feeds the router. It runs on the router's event loop, so its readers
  (``dashboard.snapshot``, from ``async`` handlers on the same loop) need no lock.
- Per worker: when its last heartbeat arrived (router clock).
- Per request, for the last ``keep_requests`` requests that arrived: a ``Trail``
  with its router records (decisions, offer outcomes, outcome: what the fact
  store gets) and its timeline marks: arrival, each offer, its answer
  (accepted, declined, timed out, worker lost, cancelled), the worker's
  restore (from its result's timings: placed after the accept plus the
  worker's queue wait, and no later than the attempt's first token), the
  first token and the deltas of each attempt, and the end.
- The infinite-cache bound: at arrival, a request's bound is the tokens of the
  longest prefix of its routable chunk chain whose keys were seen before in any
  request's prompt (chain keys hash their prefix, so those keys form a prefix;
  the tap uses ``prefix_ids``, a cheaper hash with the same prefix property,
  unless the request carries its chain); then its keys count as seen. At most ``max_seen_keys`` keys are remembered
  (the oldest forgotten first), so past that the bound is a lower bound.
- Totals over ended requests: prompt tokens, tokens served from any cache tier,
  bound tokens; and every measured TTFT with its end time, the last
  ``ttft_window_s`` seconds of them kept.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from kvrelay.core.router.events import (
    DeliverResult,
    Effect,
    MessageReceived,
    Outcome,
    Record,
    RecordKind,
    RequestArrived,
    RouterEvent,
    SendOffer,
)
from kvrelay.core.router.state import RouterState
from kvrelay.facts.queries import RequestHistory
from kvrelay.facts.record_history import history_from_records
from kvrelay.protocol.chunk_keys import cacheable_chunks
from kvrelay.protocol.messages import CACHE_TIERS, Delta, Heartbeat, Result

KEEP_REQUESTS = 256
TTFT_WINDOW_S = 300.0
MAX_SEEN_KEYS = 1_000_000


class MarkKind(StrEnum):
    """A point on a request's timeline."""

    ARRIVED = "arrived"
    OFFERED = "offered"
    ACCEPTED = "accepted"
    DECLINED = "declined"
    TIMED_OUT = "timed_out"
    WORKER_LOST = "worker_lost"
    CANCELLED = "cancelled"
    RESTORE = "restore"
    FIRST_TOKEN = "first_token"
    DELTAS = "deltas"
    ENDED = "ended"


@dataclass(frozen=True, slots=True)
class Mark:
    """``kind`` at router time ``t`` of ``attempt`` (0: the request as a whole) on ``worker_id``; ``subject`` is
    what the router saw (the ``Offer``, the offer-outcome ``Record``, the worker's ``Result``, the ``Outcome``, a
    ``DeltaRun``; None for the arrival), put into words only when the page asks (``snapshot.describe``)."""

    t: float
    attempt: int
    kind: MarkKind
    worker_id: str
    subject: object = None


@dataclass(slots=True)
class DeltaRun:
    """The deltas one attempt's worker sent: first and last arrival, messages and tokens."""

    worker_id: str
    first_t: float
    last_t: float
    messages: int = 0
    tokens: int = 0


@dataclass(slots=True)
class Trail:
    """One request as the router saw it (see the module contract)."""

    request_id: str
    model: str
    prompt_tokens: int
    arrived: float
    arrived_wall: float
    bound_tokens: int = 0
    records: list[Record] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)
    deltas: dict[int, DeltaRun] = field(default_factory=dict)
    accepted_at: dict[int, float] = field(default_factory=dict)
    outcome: Outcome | None = None
    _history: tuple[int, RequestHistory | None] = (-1, None)

    def history(self) -> RequestHistory | None:
        """The decisions and outcome ``kvrelay explain`` would read for this request (rebuilt on new records)."""
        if self._history[0] != len(self.records):
            self._history = (len(self.records), history_from_records(self.request_id, self.records))
        return self._history[1]


@dataclass(slots=True)
class Totals:
    """Sums over ended requests: prompt tokens, tokens served from cache, tokens the infinite cache would hold."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    bound_tokens: int = 0


def prefix_ids(fingerprint: bytes, prompt: tuple[int, ...], chunk_tokens: int) -> list[int]:
    """One identity per routable chunk of ``prompt``, each standing for the whole prefix up to that chunk's end
    under ``fingerprint``, as ``protocol.chunk_keys.prompt_chain``'s keys do, but from Python's tuple hash: a
    seventh of the cost of the router's content hash, which the tap would otherwise compute a second time per
    request (64-bit, so two prefixes collide with negligible odds; a statistic, never an address)."""
    ids, h = [], hash(fingerprint)
    for i in range(cacheable_chunks(len(prompt), chunk_tokens)):
        h = hash((h, prompt[i * chunk_tokens : (i + 1) * chunk_tokens]))
        ids.append(h)
    return ids


class ClusterTap:
    """Reads the router's steps into trails, heartbeat times and totals (see the module contract)."""

    def __init__(
        self,
        state: Callable[[], RouterState],
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        keep_requests: int = KEEP_REQUESTS,
        ttft_window_s: float = TTFT_WINDOW_S,
        max_seen_keys: int = MAX_SEEN_KEYS,
    ) -> None:
        self.state = state
        self.clock = clock
        self.wall = wall
        self.keep_requests = keep_requests
        self.ttft_window_s = ttft_window_s
        self.max_seen_keys = max_seen_keys
        self.heartbeat_at: dict[str, float] = {}
        self.trails: OrderedDict[str, Trail] = OrderedDict()
        self.seen: dict[Hashable, None] = {}
        self.totals = Totals()
        self.ttfts: deque[tuple[float, float]] = deque()

    def wall_time(self, t: float) -> float:
        """Router time ``t`` as wall-clock seconds since the epoch."""
        return self.wall() - (self.clock() - t)

    def recent_ttfts(self, now: float) -> list[float]:
        """TTFTs of requests that ended in the last ``ttft_window_s`` seconds."""
        while self.ttfts and self.ttfts[0][0] < now - self.ttft_window_s:
            self.ttfts.popleft()
        return [s for _, s in self.ttfts]

    # --- the observer -------------------------------------------------------

    def observe(self, event: RouterEvent, effects: list[Effect]) -> None:
        match event:
            case RequestArrived(now=now, request=request):
                self._arrived(now, request.request_id, request.model, request.prompt, request.chain)
            case MessageReceived(now=now, message=Heartbeat(worker_id=wid)):
                self.heartbeat_at[wid] = now
            case MessageReceived(now=now, message=Delta() as delta):
                self._delta(now, delta)
            case MessageReceived(now=now, message=Result() as result):
                self._result(now, result)
        for effect in effects:
            match effect:
                case SendOffer(worker_id=wid, offer=offer):
                    trail = self.trails.get(offer.assignment.request_id)
                    if trail is not None:
                        trail.marks.append(Mark(event.now, offer.assignment.attempt, MarkKind.OFFERED, wid, offer))
                case Record(kind=RecordKind.REPLICA):
                    pass
                case Record() as record:
                    self._record(record)
                case DeliverResult(request_id=rid, outcome=outcome):
                    self._ended(event.now, rid, outcome)

    # --- what each step adds ------------------------------------------------

    def _arrived(
        self, now: float, rid: str, model: str, prompt: tuple[int, ...], chain: tuple[bytes, ...] | None
    ) -> None:
        if rid in self.trails and self.trails[rid].outcome is None:
            return
        trail = Trail(rid, model, len(prompt), now, self.wall())
        trail.bound_tokens = self._bound(rid, prompt, chain)
        trail.marks.append(Mark(now, 0, MarkKind.ARRIVED, ""))
        self.trails[rid] = trail
        self.trails.move_to_end(rid)
        while len(self.trails) > self.keep_requests:
            self.trails.popitem(last=False)

    def _bound(self, rid: str, prompt: tuple[int, ...], chain: tuple[bytes, ...] | None) -> int:
        state = self.state()
        chunk_tokens = state.config.chunk_tokens
        keys: Sequence[Hashable]
        if chain is not None:
            keys = chain[: cacheable_chunks(len(prompt), chunk_tokens)]
        else:
            rs = state.requests.get(rid)
            if rs is None:
                return 0
            keys = prefix_ids(rs.fingerprint, prompt, chunk_tokens)
        held = 0
        while held < len(keys) and keys[held] in self.seen:
            held += 1
        for key in keys[held:]:
            self.seen[key] = None
        while len(self.seen) > self.max_seen_keys:
            del self.seen[next(iter(self.seen))]
        return held * chunk_tokens

    def _record(self, record: Record) -> None:
        trail = self.trails.get(record.request_id)
        if trail is None:
            return
        trail.records.append(record)
        if record.kind == RecordKind.OFFER_OUTCOME:
            outcome = record.data["outcome"]
            if outcome == MarkKind.ACCEPTED:
                trail.accepted_at[record.attempt] = record.now
            trail.marks.append(Mark(record.now, record.attempt, MarkKind(outcome), record.data["worker_id"], record))

    def _delta(self, now: float, delta: Delta) -> None:
        trail = self.trails.get(delta.assignment.request_id)
        if trail is None:
            return
        run = trail.deltas.get(delta.assignment.attempt)
        if run is None:
            run = trail.deltas[delta.assignment.attempt] = DeltaRun(delta.worker_id, now, now)
        run.last_t = now
        run.messages += 1
        run.tokens += len(delta.tokens)

    def _result(self, now: float, result: Result) -> None:
        rid, attempt = result.assignment.request_id, result.assignment.attempt
        trail = self.trails.get(rid)
        if trail is None:
            return
        accepted, run = trail.accepted_at.get(attempt), trail.deltas.get(attempt)
        at = now if accepted is None else min(now, accepted + result.timings.queue_s)
        at = at if run is None else min(at, run.first_t)
        trail.marks.append(Mark(at, attempt, MarkKind.RESTORE, result.worker_id, result))

    def _ended(self, now: float, rid: str, outcome: Outcome) -> None:
        trail = self.trails.get(rid)
        if trail is None or trail.outcome is not None:
            return
        trail.outcome = outcome
        trail.marks.append(Mark(now, 0, MarkKind.ENDED, "", outcome))
        self.totals.requests += 1
        self.totals.prompt_tokens += trail.prompt_tokens
        self.totals.cached_tokens += sum(n for tier, n in outcome.usage.cached_tokens.items() if tier in CACHE_TIERS)
        self.totals.bound_tokens += trail.bound_tokens
        if outcome.ttft_s is not None:
            self.ttfts.append((now, outcome.ttft_s))
