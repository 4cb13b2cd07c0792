"""The predicted time to first token of one candidate, term by term, and the data it is computed from.

A candidate serves a request on one worker from a route (``routes``): a
prefix restored tier by tier, the rest recomputed. Its predicted TTFT is

    max(queue delay, lower-tier load if the route restores)          (queue_s)
      + restore bytes / restore rate of each tier used                (restore_s)
      + uncached prompt tokens * prefill seconds per token             (prefill_s)
      + one decode step                                                (decode_s)
      [+ one decode step per further prefill chunk, when counted]

The queue delay is the worker's last reported queue plus what the router sent
there that the report does not count yet: the predicted restore + prefill of
the offers not yet answered, and of those accepted after that report was made.
A worker's messages reach the router in order and it queues an offer's prompt
when it accepts it, so a heartbeat that arrives after an offer's acceptance
counts it (``WorkerLoad``). (It was the larger of the report and every offer
whose first token had not come back: a prefill half done counted whole until its
first token, so a worker that could start a request within the router queue's
bound looked as if it could not.) The lower-tier load drains like a
fluid from the last heartbeat's value plus the restores sent since. The
restore adds to the queue rather than overlapping it: a worker hands a
restored route to its device queue only when the copy has completed (docs/design.md
section 8), behind whatever arrived meanwhile (refinements tried and dropped:
docs/performance.md, "Predicted TTFT: refinements not taken"). A worker whose queue is empty but which has active
decode lanes runs a decode step between the chunks of a long prefill; the
``Scoring.interleave`` flag counts those steps for such workers, where the lanes
the prefill will meet are known (kvrelay's policy sets it while the cluster is
calm, ``policies.kvrelay_ttft``).

Candidates are ranked by a score: the predicted TTFT plus ``Scoring.work_weight`` times
the work of the candidate's prefill. Recomputing occupies the device that every
later request queues behind, which a request's own TTFT does not count; kvrelay's
policy weighs that work by how busy the cluster is (``policies.kvrelay_ttft``),
the other policies plan with weight 0, where the score is the predicted TTFT.
The work is priced per token at the cluster's rate (``Scoring.work_s_per_token``,
``Roster.work_s_per_token``), not at the candidate worker's: a token computed on a
slow worker takes no more of the cluster's capacity than one computed on a fast
worker (the slower prefill is already in the predicted TTFT). Pricing it at the
worker's own rate charged a slow worker's candidates its slowness twice over,
so on a mixed fleet the fast workers filled their pages with short prompts and
the long prompts, which most need them, found room only on slow workers
(docs/performance.md, "Work on a mixed fleet"). On a fleet of one speed both
prices are the same number.

Everything here is pure; ``candidates`` plans with it (docs/design.md section 6).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec

from kvrelay.core.planning.routes import Boundary
from kvrelay.protocol.messages import Heartbeat, RouteSegment, Tier


class Scoring(NamedTuple):
    """How a plan ranks candidates beyond their predicted TTFT (see the module docstring)."""

    work_weight: float = 0.0
    """Seconds of score added per second of the candidate's own prefill."""
    interleave: bool = False
    """Count the decode steps an idle worker with active lanes runs between the chunks of the prefill."""
    pending: bool = False
    """Count the chunks routed requests are computing on a worker as cached there (``planning.pending``)."""
    work_s_per_token: float = 0.0
    """What one uncached token of work costs the cluster, in seconds, for the work term; 0: the candidate's
    own worker's ``prefill_s_per_token`` (see ``score_per_token``)."""


PREDICTED_TTFT = Scoring()
"""Rank by the predicted TTFT alone."""


class Terms(msgspec.Struct, frozen=True):
    """The predicted TTFT of a candidate, term by term (seconds; see the module docstring)."""

    queue_s: float
    restore_s: dict[Tier, float]
    prefill_s: float
    decode_s: float
    """The first decode step, plus the decode steps interleaved with the prefill when counted."""

    @property
    def total_s(self) -> float:
        return self.queue_s + sum(self.restore_s.values()) + self.prefill_s + self.decode_s


class Candidate(msgspec.Struct, frozen=True):
    """One way to serve a request on one worker; an empty route recomputes everything."""

    worker_id: str
    epoch: int
    route: tuple[RouteSegment, ...]
    cached_tokens: int
    predicted_ttft_s: float
    terms: Terms
    score_s: float = 0.0
    """What the candidate was ranked by: ``predicted_ttft_s`` plus the work weight times ``terms.prefill_s``."""

    @property
    def tiers(self) -> frozenset[str]:
        return frozenset(s.tier for s in self.route)


@dataclass(slots=True)
class WorkerLoad:
    """What the router itself knows of a worker's load beyond its last heartbeat."""

    restore_backlog_s: float = 0.0
    """Restore work (seconds) queued at ``restore_backlog_at``: the last heartbeat's lower-tier load plus the
    restores of every offer sent since; it drains at one second per second."""
    restore_backlog_at: float = 0.0
    outstanding_s: float = 0.0
    """Predicted restore + prefill seconds of offers sent there whose first token has not arrived."""
    unheard_s: float = 0.0
    """The part of ``outstanding_s`` the worker's last heartbeat does not count: offers not yet answered, and
    offers accepted after that heartbeat was made."""
    accepted_unheard_s: float = 0.0
    """The part of ``unheard_s`` of offers accepted since the last heartbeat arrived (the next one counts it)."""
    heartbeats: int = 0
    """Heartbeats taken from the worker: an acceptance of an earlier count is in the last one."""
    inflight_pages: int = 0
    """Pages demanded by offers sent there and not yet answered."""
    accepted_pages: int = 0
    """Pages of offers accepted since that worker's last heartbeat and not ended since."""
    released_pages: int = 0
    """Pages of requests that ended since that worker's last heartbeat, which that heartbeat counted in use."""
    active: int = 0
    """Assignments currently offered to or running on the worker."""

    def release_outstanding(self, estimate_s: float) -> None:
        """Take back one offer's estimate; what is left of adding and subtracting the same floats is zero,
        so workers that are alike stay exactly tied (and ties go to the lower worker id)."""
        self.outstanding_s = _less(self.outstanding_s, estimate_s)

    def offered(self, estimate_s: float) -> None:
        """An offer of ``estimate_s`` was sent: outstanding, and not in any heartbeat yet."""
        self.outstanding_s += estimate_s
        self.unheard_s += estimate_s

    def accepted(self, estimate_s: float) -> int:
        """The worker accepted an offer of ``estimate_s``: the next heartbeat counts it. Returns the heartbeat
        count to hand back to ``unheard_released``."""
        self.accepted_unheard_s += estimate_s
        return self.heartbeats

    def pages_accepted(self, pages: int) -> int:
        """The worker accepted an offer of ``pages``: they count until the next heartbeat, which reports them.
        Returns the heartbeat count to hand back to ``pages_released``."""
        self.accepted_pages += pages
        return self.heartbeats

    @property
    def pages_held(self) -> int:
        """Pages to count against the worker beyond its last heartbeat's figures: offers in flight and accepted
        since, less the pages of requests that ended since (negative where those outweigh them)."""
        return self.inflight_pages + self.accepted_pages - self.released_pages

    def pages_released(self, pages: int, accepted_at: int) -> None:
        """An accepted offer of ``pages`` ended; ``accepted_at``: what ``pages_accepted`` returned for it. The
        worker freed its pages, and no heartbeat says so before the next one: until then they count as free
        again, taken out of ``accepted_pages`` where no heartbeat came since its acceptance, else added to
        ``released_pages``."""
        if accepted_at == self.heartbeats:
            self.accepted_pages = max(0, self.accepted_pages - pages)
        else:
            self.released_pages += pages

    def heard(self) -> None:
        """A heartbeat arrived: it counts every offer accepted before it and every request that ended before it."""
        self.accepted_pages = self.released_pages = 0
        self.unheard_s = _less(self.unheard_s, self.accepted_unheard_s)
        self.accepted_unheard_s = 0.0
        self.heartbeats += 1

    def unheard_released(self, estimate_s: float, accepted_at: int | None) -> None:
        """An offer of ``estimate_s`` ended or had its first token; ``accepted_at``: what ``accepted`` returned
        for it, None if it was not accepted. Takes it out of ``unheard_s`` unless a heartbeat counted it."""
        if accepted_at is None:
            self.unheard_s = _less(self.unheard_s, estimate_s)
        elif accepted_at == self.heartbeats:
            self.unheard_s = _less(self.unheard_s, estimate_s)
            self.accepted_unheard_s = _less(self.accepted_unheard_s, estimate_s)


def _less(total: float, part: float) -> float:
    """``total - part``, exactly zero where float residue is all that is left."""
    left = total - part
    return left if left > 1e-9 else 0.0


@dataclass(frozen=True, slots=True)
class WorkerView:
    """A live worker as candidate planning sees it."""

    heartbeat: Heartbeat
    load: WorkerLoad
    fingerprints: dict[str, bytes]
    """Model name -> fingerprint of the KV this worker produces for it."""
    signature: tuple[float, int, float, float] = field(init=False)
    """What the cost of a route without local chunks depends on: workers alike share it."""

    def __post_init__(self) -> None:
        hb = self.heartbeat
        rates = hb.restore_bytes_per_s
        object.__setattr__(
            self,
            "signature",
            (hb.prefill_s_per_token, hb.kv_bytes_per_token, rates.get("peer", 0.0), rates.get("object", 0.0)),
        )


def reported_fingerprints(hb: Heartbeat) -> dict[str, bytes]:
    """Fingerprints a heartbeat reports per model; a model without one is fingerprinted by its name."""
    out = {m: m.encode() for m in hb.models}
    for model, hex_fp in zip(hb.models, hb.model_fingerprints):
        try:
            out[model] = bytes.fromhex(hex_fp) if hex_fp else out[model]
        except ValueError:
            continue
    return out


def pages_needed(tokens: int, page_tokens: int) -> int:
    """Pages that hold ``tokens`` tokens at ``page_tokens`` per page (the one page arithmetic of the project)."""
    return -(-tokens // page_tokens)


def page_demand(prompt_len: int, max_new: int, gpu_cached_tokens: int, page_tokens: int) -> int:
    """Pages for prompt plus maximum generation, minus shared resident prefix pages, plus a
    copy-on-write page when the shared prefix ends inside a page (docs/design.md section 7)."""
    shared = gpu_cached_tokens // page_tokens
    cow = 1 if gpu_cached_tokens % page_tokens else 0
    return pages_needed(prompt_len + max_new, page_tokens) - shared + cow


def score_per_token(hb: Heartbeat, scoring: Scoring) -> float:
    """Score seconds per uncached prompt token on a worker like ``hb``: its prefill plus the weighted work.

    With no cluster price, or one equal to the worker's own rate, this is ``prefill_s_per_token * (1 +
    work_weight)`` exactly (the same float as before the price existed, so a fleet of one speed plans
    bit for bit as it did).
    """
    own = hb.prefill_s_per_token
    price = scoring.work_s_per_token
    if price <= 0.0 or price == own:
        return own * (1.0 + scoring.work_weight)
    return own + scoring.work_weight * price


def interleave_chunk(hb: Heartbeat, base_queue: float, scoring: Scoring) -> int:
    """The prefill chunk between whose iterations decode steps are counted; 0: none are counted.

    Counted only when ``scoring.interleave`` is set, the worker reports its chunk size and active
    lanes, and its queue is empty: then the prefill starts now and meets those lanes.
    """
    if not scoring.interleave or base_queue > 0.0 or not hb.active_lanes:
        return 0
    return hb.prefill_chunk_tokens


def interleaved_steps(uncached: int, chunk: int) -> int:
    """Decode steps run between the chunks of a prefill of ``uncached`` tokens; 0 when ``chunk`` is 0."""
    return (uncached - 1) // chunk if chunk and uncached > 0 else 0


def prompt_queue_of(worker: WorkerView) -> float:
    """The prompt work queued on the worker: the reported queue plus what the report does not count."""
    return worker.heartbeat.queue_delay_s + worker.load.unheard_s


def queue_of(worker: WorkerView, now: float) -> float:
    """The device queue a new request would wait behind: ``prompt_queue_of``, plus the worker's cost per request
    in flight times the requests the router has in flight there."""
    return prompt_queue_of(worker) + worker.heartbeat.per_request_s * worker.load.active


def lower_load_of(worker: WorkerView, now: float) -> float:
    """How long a new restore would wait for the worker's restore channel at ``now``."""
    load = worker.load
    return max(0.0, load.restore_backlog_s - max(0.0, now - load.restore_backlog_at))


def make_candidate(
    hb: Heartbeat,
    base_queue: float,
    lower_load: float,
    segments: tuple[RouteSegment, ...],
    boundary: Boundary,
    prompt_len: int,
    chunk_tokens: int,
    scoring: Scoring = PREDICTED_TTFT,
) -> Candidate:
    """The candidate of one boundary, with its predicted TTFT broken into terms and its score."""
    cached, _, restored, used = boundary
    chunk_bytes = hb.kv_bytes_per_token * chunk_tokens
    restore = {tier: chunks * chunk_bytes / hb.restore_bytes_per_s[tier] for tier, chunks in restored}
    total_restore = sum(restore.values())
    queue = max(base_queue, lower_load) if restore else base_queue
    prefill = (prompt_len - cached) * hb.prefill_s_per_token
    steps = interleaved_steps(prompt_len - cached, interleave_chunk(hb, base_queue, scoring))
    decode = hb.decode_s_per_token + hb.decode_s_per_token * steps
    price = scoring.work_s_per_token
    if price <= 0.0 or price == hb.prefill_s_per_token:
        weighted = prefill * (1.0 + scoring.work_weight)
    else:
        weighted = prefill + scoring.work_weight * price * (prompt_len - cached)
    return Candidate(
        worker_id=hb.worker_id,
        epoch=hb.epoch,
        route=segments[:used],
        cached_tokens=cached,
        predicted_ttft_s=queue + total_restore + prefill + decode,
        terms=Terms(queue, restore, prefill, decode),
        score_s=queue + total_restore + weighted + decode,
    )
