"""Candidate planning and the predicted-TTFT score (DESIGN.md section 6).

For one request and every worker, walk the request's chunk chain and take, per
chunk, the fastest tier that worker can reach (its own gpu, ram, ssd; a peer's
ram or ssd; the shared object tier). Every boundary where the tier changes is
a candidate, and so is recomputing everything. Each candidate's predicted time
to first token is

    max(queue delay, lower-tier load if the route restores)          (queue_s)
      + restore bytes / restore rate of each tier used                (restore_s)
      + uncached prompt tokens * prefill seconds per token             (prefill_s)
      + one decode step                                                (decode_s)
      [+ one decode step per further prefill chunk, when counted]

The queue delay is the larger of the worker's last reported queue and the
router's own knowledge: the predicted restore + prefill of the offers it sent
there whose first token has not come back. The lower-tier load drains like a
fluid from the last heartbeat's value plus the restores sent since. The
restore adds to the queue rather than overlapping it: a worker hands a
restored route to its device queue only when the copy has completed (DESIGN.md
section 8), behind whatever arrived meanwhile. (Three refinements were measured
in the simulator on the dev trace at 1x and 2x the recorded rate and dropped
because they did not lower mean and p99 TTFT at both: a restore overlapping the
queue, a fluid model of the device queue, and one decode step per chunked-prefill
iteration on every worker.) A worker whose queue is empty but which has active
decode lanes runs a decode step between the chunks of a long prefill; the
``Scoring.interleave`` flag counts those steps for such workers, where the lanes
the prefill will meet are known (kvrelay's policy sets it while the cluster is
calm, ``policies.kvrelay_ttft``).

Candidates are ranked by a score: the predicted TTFT plus ``Scoring.work_weight`` times
the candidate's prefill seconds. Recomputing occupies the device that every
later request queues behind, which a request's own TTFT does not count; kvrelay's
policy weighs that work by how busy the cluster is (``policies.kvrelay_ttft``),
the other policies plan with weight 0, where the score is the predicted TTFT.

Cost is linear inside a segment, so the optimum always lies on a boundary.
Hard constraints (model, epoch, context limit, page capacity, exactness of the
chain) filter first; ``Plan.excluded`` says which one removed each worker.
Everything here is pure: same inputs, same plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec

from kvrelay.controller.index import GPU, LOCAL_MASK, RAM, SSD, ResidencyIndex
from kvrelay.controller.routes import Boundary, Run, boundaries_of, runs_of, walk_route
from kvrelay.protocol.messages import Heartbeat, RouteSegment

EXCLUDED_AFTER_FAILURE = "excluded after an earlier failure of this request"


class Scoring(NamedTuple):
    """How a plan ranks candidates beyond their predicted TTFT (see the module docstring)."""

    work_weight: float = 0.0
    """Seconds of score added per second of the candidate's own prefill."""
    interleave: bool = False
    """Count the decode steps an idle worker with active lanes runs between the chunks of the prefill."""


PREDICTED_TTFT = Scoring()
"""Rank by the predicted TTFT alone."""

BestInputs = tuple[Heartbeat, float, float, tuple[RouteSegment, ...], Boundary, int, int, Scoring]
"""``make_candidate``'s arguments: heartbeat, base queue, lower-tier load, segments, boundary, prompt length,
chunk tokens, scoring."""


class Terms(msgspec.Struct, frozen=True):
    """The predicted TTFT of a candidate, term by term (seconds; see the module docstring)."""

    queue_s: float
    restore_s: dict[str, float]
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
    inflight_pages: int = 0
    """Pages demanded by offers sent there and not yet answered."""
    accepted_pages: int = 0
    """Pages of offers accepted since that worker's last heartbeat."""
    active: int = 0
    """Assignments currently offered to or running on the worker."""

    def release_outstanding(self, estimate_s: float) -> None:
        """Take back one offer's estimate; what is left of adding and subtracting the same floats is zero,
        so workers that are alike stay exactly tied (and ties go to the lower worker id)."""
        left = self.outstanding_s - estimate_s
        self.outstanding_s = left if left > 1e-9 else 0.0


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
        object.__setattr__(self, "signature", (hb.prefill_s_per_token, hb.kv_bytes_per_token,
                                               rates.get("peer", 0.0), rates.get("object", 0.0)))


def reported_fingerprints(hb: Heartbeat) -> dict[str, bytes]:
    """Fingerprints a heartbeat reports per model; a model without one is fingerprinted by its name."""
    out = {m: m.encode() for m in hb.models}
    for model, hex_fp in zip(hb.models, hb.model_fingerprints):
        try:
            out[model] = bytes.fromhex(hex_fp) if hex_fp else out[model]
        except ValueError:
            continue
    return out


class WorkerRoute:
    """The longest route a worker can reach for a chain and its cheapest boundary.

    ``best`` materializes that boundary's ``Candidate`` on first use (most
    workers' candidates are compared by ``best_score`` alone);
    ``alternatives`` lists all of them.
    """

    __slots__ = ("worker_id", "segments", "bounds", "best_score", "best_index", "heartbeat", "base_queue_s",
                 "lower_load_s", "prompt_len", "chunk_tokens", "scoring", "_best")

    def __init__(self, view: WorkerView, segments: tuple[RouteSegment, ...], bounds: list[Boundary],
                 best_score: float, best_index: int, prompt_len: int, chunk_tokens: int, now: float,
                 scoring: Scoring = PREDICTED_TTFT) -> None:
        self.worker_id = view.heartbeat.worker_id
        self.heartbeat = view.heartbeat
        self.base_queue_s = queue_of(view, now)
        self.lower_load_s = lower_load_of(view, now)
        """Captured now: the route stays a true snapshot after the worker's load changes."""
        self.segments = segments
        self.bounds = bounds
        self.best_score = best_score
        self.best_index = best_index
        self.prompt_len = prompt_len
        self.chunk_tokens = chunk_tokens
        self.scoring = scoring
        self._best: Candidate | None = None

    @property
    def best(self) -> Candidate:
        if self._best is None:
            self._best = make_candidate(*self.best_inputs())
        return self._best

    def best_inputs(self) -> BestInputs:
        """``make_candidate``'s arguments for the best boundary (a decision record ships these, not the candidate)."""
        return (self.heartbeat, self.base_queue_s, self.lower_load_s, self.segments, self.bounds[self.best_index],
                self.prompt_len, self.chunk_tokens, self.scoring)

    @property
    def cached_tokens(self) -> int:
        return self.bounds[self.best_index][0]

    # The best candidate's fields, so a decision record can hold routes and expand them off the routing path.
    @property
    def route(self) -> tuple[RouteSegment, ...]:
        return self.best.route

    @property
    def predicted_ttft_s(self) -> float:
        return self.best.predicted_ttft_s

    @property
    def terms(self) -> Terms:
        return self.best.terms


@dataclass(slots=True)
class Plan:
    routes: list[WorkerRoute] = field(default_factory=list)
    excluded: dict[str, str] = field(default_factory=dict)
    pruned: dict[str, float] = field(default_factory=dict)
    """Workers skipped because a lower bound on their score exceeded the best found (``roster.plan_pruned``)."""

    def best(self) -> Candidate | None:
        """The lowest score; ties broken by worker id."""
        if not self.routes:
            return None
        return min(self.routes, key=lambda r: (r.best_score, r.worker_id)).best


def pages_needed(tokens: int, page_tokens: int) -> int:
    """Pages that hold ``tokens`` tokens at ``page_tokens`` per page (the one page arithmetic of the project)."""
    return -(-tokens // page_tokens)


def page_demand(prompt_len: int, max_new: int, gpu_cached_tokens: int, page_tokens: int) -> int:
    """Pages for prompt plus maximum generation, minus shared resident prefix pages, plus a
    copy-on-write page when the shared prefix ends inside a page (DESIGN.md section 7)."""
    shared = gpu_cached_tokens // page_tokens
    cow = 1 if gpu_cached_tokens % page_tokens else 0
    return pages_needed(prompt_len + max_new, page_tokens) - shared + cow


def _evaluate(
    worker: WorkerView, boundaries: list[Boundary], prompt_len: int, max_new: int, chunk_tokens: int, now: float,
    scoring: Scoring,
) -> list[tuple[float, int]]:
    """``(score, boundary index)`` of every boundary that fits the worker's capacity.

    Keep in step with ``make_candidate``, which computes the same sum term by term.
    """
    hb, load = worker.heartbeat, worker.load
    pt = hb.page_tokens
    available = hb.pages_free + hb.pages_evictable - load.inflight_pages - load.accepted_pages
    chunk_bytes = hb.kv_bytes_per_token * chunk_tokens
    base_queue = queue_of(worker, now)
    lower_load = lower_load_of(worker, now)
    per_token = hb.prefill_s_per_token * (1.0 + scoring.work_weight)
    fixed = prompt_len * per_token
    decode = hb.decode_s_per_token
    chunk = interleave_chunk(hb, base_queue, scoring)
    rates = hb.restore_bytes_per_s
    total_pages = -(-(prompt_len + max_new) // pt)
    out: list[tuple[float, int]] = []
    for i, (cached, gpu, restored, _) in enumerate(boundaries):
        restore = 0.0
        for tier, chunks in restored:
            rate = rates.get(tier, 0.0)
            if rate <= 0.0:
                return out
            restore += chunks * chunk_bytes / rate
        if total_pages - gpu // pt + (1 if gpu % pt else 0) > available:
            continue
        wait = max(base_queue, lower_load) + restore if restore else base_queue
        steps = interleaved_steps(prompt_len - cached, chunk)
        out.append((wait + fixed - cached * per_token + decode + decode * steps, i))
    return out


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


def queue_of(worker: WorkerView, now: float) -> float:
    """The device queue a new request would wait behind: the larger of the reported and the router-known one."""
    return max(worker.heartbeat.queue_delay_s, worker.load.outstanding_s)


def lower_load_of(worker: WorkerView, now: float) -> float:
    """How long a new restore would wait for the worker's restore channel at ``now``."""
    load = worker.load
    return max(0.0, load.restore_backlog_s - max(0.0, now - load.restore_backlog_at))


def intrinsic_cost(hb: Heartbeat, bounds: list[Boundary], prompt_len: int, chunk_tokens: int,
                   scoring: Scoring) -> float:
    """The lowest score over ``bounds`` on a worker like ``hb`` without its queue and decode step."""
    chunk_bytes = hb.kv_bytes_per_token * chunk_tokens
    per_token = hb.prefill_s_per_token * (1.0 + scoring.work_weight)
    best = prompt_len * per_token
    for cached, _, restored, _ in bounds[1:]:
        restore = 0.0
        for tier, chunks in restored:
            rate = hb.restore_bytes_per_s.get(tier, 0.0)
            if rate <= 0.0:
                return best
            restore += chunks * chunk_bytes / rate
        best = min(best, restore + (prompt_len - cached) * per_token)
    return best


def make_candidate(
    hb: Heartbeat, base_queue: float, lower_load: float, segments: tuple[RouteSegment, ...], boundary: Boundary,
    prompt_len: int, chunk_tokens: int, scoring: Scoring = PREDICTED_TTFT,
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
    return Candidate(
        worker_id=hb.worker_id,
        epoch=hb.epoch,
        route=segments[:used],
        cached_tokens=cached,
        predicted_ttft_s=queue + total_restore + prefill + decode,
        terms=Terms(queue, restore, prefill, decode),
        score_s=queue + total_restore + prefill * (1.0 + scoring.work_weight) + decode,
    )


def alternatives(route: WorkerRoute, worker: WorkerView, prompt_len: int, max_new: int, chunk_tokens: int,
                 now: float) -> list[Candidate]:
    """Every feasible boundary candidate of one worker at ``now``, lowest score first."""
    bounds = boundaries_of(route.segments, chunk_tokens)
    s = route.scoring
    scored = sorted(_evaluate(worker, bounds, prompt_len, max_new, chunk_tokens, now, s), key=lambda x: (x[0], -x[1]))
    base_queue, lower_load = queue_of(worker, now), lower_load_of(worker, now)
    return [make_candidate(worker.heartbeat, base_queue, lower_load, route.segments, bounds[i], prompt_len,
                           chunk_tokens, s) for _, i in scored]


SharedRoute = tuple[tuple[RouteSegment, ...], list[Boundary]]


def shared_route(runs: Sequence[Run], index: ResidencyIndex, chunk_tokens: int) -> tuple[SharedRoute, int]:
    """The route of a worker holding no local copy, with its boundaries, and the OR of the runs' values."""
    present = 0
    for value, _ in runs:
        present |= value
    segments = walk_route(runs, index, None, 0, True, True) if runs else ()
    return (segments, boundaries_of(segments, chunk_tokens)), present


def route_for(
    request_model: str, prompt_len: int, max_new: int, runs: Sequence[Run], chain_fingerprint: bytes,
    chunk_tokens: int, worker: WorkerView, index: ResidencyIndex,
    excluded_pairs: frozenset[tuple[str, str]] | set[tuple[str, str]], shared: SharedRoute, present: int,
    now: float, scoring: Scoring,
) -> WorkerRoute | None:
    """One eligible worker's longest reachable route and its cheapest feasible boundary; None: no capacity.

    ``shared`` is ``shared_route(runs, ...)``: the route of any worker without local copies;
    ``present`` is the OR of the chain's packed index values.
    """
    hb = worker.heartbeat
    wid = hb.worker_id
    if not runs or worker.fingerprints.get(request_model) != chain_fingerprint or hb.chunk_tokens != chunk_tokens:
        segments: tuple[RouteSegment, ...] = ()
        bounds = boundaries_of(segments, chunk_tokens)
    else:
        allowed, allow_peer, allow_object = LOCAL_MASK, True, True
        if excluded_pairs:
            for tier, bit in (("gpu", GPU), ("ram", RAM), ("ssd", SSD)):
                if (wid, tier) in excluded_pairs:
                    allowed &= ~bit
            allow_peer = (wid, "peer") not in excluded_pairs
            allow_object = (wid, "object") not in excluded_pairs
        shift = index.shift_of(wid)
        local = shift is not None and (present >> shift) & LOCAL_MASK
        if not local and allow_peer and allow_object:
            segments, bounds = shared
        else:
            segments = walk_route(runs, index, shift, allowed, allow_peer, allow_object)
            bounds = boundaries_of(segments, chunk_tokens)
    scored = _evaluate(worker, bounds, prompt_len, max_new, chunk_tokens, now, scoring)
    if not scored:
        return None
    best_t, best_i = min(scored, key=lambda x: (x[0], -x[1])) if len(scored) > 1 else scored[0]
    return WorkerRoute(worker, segments, bounds, best_t, best_i, prompt_len, chunk_tokens, now, scoring)


def plan(
    request_model: str,
    prompt_len: int,
    max_new: int,
    chain: Sequence[bytes],
    chain_fingerprint: bytes,
    chunk_tokens: int,
    workers: Sequence[WorkerView],
    index: ResidencyIndex,
    excluded_workers: frozenset[str] | set[str] = frozenset(),
    excluded_pairs: frozenset[tuple[str, str]] | set[tuple[str, str]] = frozenset(),
    now: float = 0.0,
    scoring: Scoring = PREDICTED_TTFT,
) -> Plan:
    """Candidates of every eligible worker for one request at ``now`` (see the module docstring).

    ``roster.plan_pruned`` finds the same best candidate while skipping workers that cannot win.
    """
    result = Plan()
    runs = runs_of(index.lookup(chain))
    shared, present = shared_route(runs, index, chunk_tokens)
    need = prompt_len + max_new
    for worker in workers:
        hb = worker.heartbeat
        wid = hb.worker_id
        if wid in excluded_workers:
            result.excluded[wid] = EXCLUDED_AFTER_FAILURE
        elif request_model not in hb.models:
            result.excluded[wid] = f"model '{request_model}' not served"
        elif need > hb.context_limit:
            result.excluded[wid] = f"context limit {hb.context_limit} < {need}"
        else:
            route = route_for(request_model, prompt_len, max_new, runs, chain_fingerprint, chunk_tokens, worker,
                              index, excluded_pairs, shared, present, now, scoring)
            if route is None:
                result.excluded[wid] = "capacity"
            else:
                result.routes.append(route)
    return result
