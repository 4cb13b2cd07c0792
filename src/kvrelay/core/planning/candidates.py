"""Candidate planning (docs/design.md section 6): every worker's longest reachable route and its cheapest boundary.

For one request and every worker, walk the request's chunk chain and take, per
chunk, the fastest tier that worker can reach (its own gpu, ram, ssd; a peer's
ram or ssd; the shared object tier). Every boundary where the tier changes is
a candidate, and so is recomputing everything. Each candidate is scored by its
predicted time to first token (``predicted_ttft``). Cost is linear inside a
segment, so the optimum always lies on a boundary. Hard constraints (model, epoch, context limit, page capacity,
exactness of the chain) filter first; ``Plan.excluded`` says which one removed
each worker. Everything here is pure: same inputs, same plan.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvrelay.core.planning import exclusions
from kvrelay.core.planning.exclusions import Exclusion
from kvrelay.core.planning.index import GPU, LOCAL_MASK, PENDING, RAM, SSD, ResidencyIndex
from kvrelay.core.planning.predicted_ttft import (
    PREDICTED_TTFT,
    Candidate,
    Scoring,
    Terms,
    WorkerView,
    interleave_chunk,
    interleaved_steps,
    lower_load_of,
    make_candidate,
    queue_of,
    score_per_token,
)
from kvrelay.core.planning.routes import Boundary, Run, boundaries_of, walk_route
from kvrelay.protocol.messages import Heartbeat, RouteSegment

__all__ = [
    "BestInputs",
    "Plan",
    "SharedRoute",
    "WorkerRoute",
    "alternatives",
    "intrinsic_cost",
    "plan",
    "route_for",
    "shared_route",
]

BestInputs = tuple[Heartbeat, float, float, tuple[RouteSegment, ...], Boundary, int, int, Scoring]
"""``make_candidate``'s arguments: heartbeat, base queue, lower-tier load, segments, boundary, prompt length,
chunk tokens, scoring."""


class WorkerRoute:
    """The longest route a worker can reach for a chain and its cheapest boundary.

    ``best`` materializes that boundary's ``Candidate`` on first use (most
    workers' candidates are compared by ``best_score`` alone);
    ``alternatives`` lists all of them, ``alternative_routes`` the same as
    routes ending at each boundary (``at``).
    """

    __slots__ = (
        "worker_id",
        "segments",
        "bounds",
        "best_score",
        "best_index",
        "heartbeat",
        "base_queue_s",
        "lower_load_s",
        "prompt_len",
        "chunk_tokens",
        "scoring",
        "_best",
        "feasible",
        "planned_for",
    )

    def __init__(
        self,
        view: WorkerView,
        segments: tuple[RouteSegment, ...],
        bounds: list[Boundary],
        best_score: float,
        best_index: int,
        prompt_len: int,
        chunk_tokens: int,
        now: float,
        scoring: Scoring = PREDICTED_TTFT,
        base_queue_s: float | None = None,
        lower_load_s: float | None = None,
    ) -> None:
        """``base_queue_s`` and ``lower_load_s``, when given, are ``queue_of(view, now)`` and
        ``lower_load_of(view, now)``."""
        self.worker_id = view.heartbeat.worker_id
        self.heartbeat = view.heartbeat
        self.base_queue_s = queue_of(view, now) if base_queue_s is None else base_queue_s
        self.lower_load_s = lower_load_of(view, now) if lower_load_s is None else lower_load_s
        """Captured now: the route stays a true snapshot after the worker's load changes."""
        self.segments = segments
        self.bounds = bounds
        self.best_score = best_score
        self.best_index = best_index
        self.prompt_len = prompt_len
        self.chunk_tokens = chunk_tokens
        self.scoring = scoring
        self._best: Candidate | None = None
        self.feasible: list[tuple[float, int]] | None = None
        """``(score, boundary index)`` of every feasible boundary when planned (``route_for``), or None."""
        self.planned_for: tuple[object, ...] = ()
        """What ``feasible`` was computed from besides the route (``alternative_routes`` reuses it if unchanged)."""

    def at(self, index: int, score: float, base_queue_s: float, lower_load_s: float) -> WorkerRoute:
        """The same route ending at boundary ``index`` (whose score is ``score``) instead of the best one."""
        other = object.__new__(WorkerRoute)
        other.worker_id, other.heartbeat, other.segments, other.bounds = (
            self.worker_id,
            self.heartbeat,
            self.segments,
            self.bounds,
        )
        other.prompt_len, other.chunk_tokens, other.scoring = self.prompt_len, self.chunk_tokens, self.scoring
        other.base_queue_s, other.lower_load_s = base_queue_s, lower_load_s
        other.best_index, other.best_score, other._best = index, score, None
        other.feasible, other.planned_for = None, ()
        return other

    @property
    def best(self) -> Candidate:
        if self._best is None:
            self._best = make_candidate(*self.best_inputs())
        return self._best

    def best_inputs(self) -> BestInputs:
        """``make_candidate``'s arguments for the best boundary (a decision record ships these, not the candidate)."""
        return (
            self.heartbeat,
            self.base_queue_s,
            self.lower_load_s,
            self.segments,
            self.bounds[self.best_index],
            self.prompt_len,
            self.chunk_tokens,
            self.scoring,
        )

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
    excluded: dict[str, Exclusion] = field(default_factory=dict)
    pruned: Mapping[str, float] = field(default_factory=dict)
    """Workers skipped because a lower bound on their score exceeded the best found (``roster.plan_pruned``)."""
    available_chunks: int = 0
    """The chain's leading chunks the index holds anywhere (any worker's tier or pending mark, the object tier):
    what an ideal route could reuse (``core.router.reuse``)."""

    def best(self) -> Candidate | None:
        """The lowest score; ties broken by worker id."""
        return lowest_route(self.routes).best if self.routes else None


def lowest_route(routes: Sequence[WorkerRoute]) -> WorkerRoute:
    """The route with the lowest score; ties broken by worker id (``routes`` not empty)."""
    return min(routes, key=lambda r: (r.best_score, r.worker_id))


def _evaluate(
    worker: WorkerView,
    boundaries: list[Boundary],
    prompt_len: int,
    max_new: int,
    chunk_tokens: int,
    base_queue: float,
    lower_load: float,
    scoring: Scoring,
) -> list[tuple[float, int]]:
    """``(score, boundary index)`` of every boundary that fits the worker's capacity, in boundary order;
    ``base_queue`` and ``lower_load`` are ``queue_of`` and ``lower_load_of`` the worker at planning time.

    Keep in step with ``make_candidate``, which computes the same sum term by term.
    """
    hb, load = worker.heartbeat, worker.load
    pt = hb.page_tokens
    available = hb.pages_free + hb.pages_evictable - load.pages_held
    chunk_bytes = hb.kv_bytes_per_token * chunk_tokens
    per_token = score_per_token(hb, scoring)
    fixed = prompt_len * per_token
    decode = hb.decode_s_per_token
    chunk = interleave_chunk(hb, base_queue, scoring)
    rates = hb.restore_bytes_per_s
    total_pages = -(-(prompt_len + max_new) // pt)
    restoring_queue = max(base_queue, lower_load)
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
        wait = restoring_queue + restore if restore else base_queue
        steps = interleaved_steps(prompt_len - cached, chunk) if chunk else 0
        out.append((wait + fixed - cached * per_token + decode + decode * steps, i))
    return out


def intrinsic_cost(
    hb: Heartbeat, bounds: list[Boundary], prompt_len: int, chunk_tokens: int, scoring: Scoring
) -> float:
    """The lowest score over ``bounds`` on a worker like ``hb`` without its queue and decode step."""
    chunk_bytes = hb.kv_bytes_per_token * chunk_tokens
    per_token = score_per_token(hb, scoring)
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


def _by_rank(scored: list[tuple[float, int]]) -> list[tuple[float, int]]:
    """Lowest score first; among equal scores the longer route (higher boundary index) first."""
    return sorted(scored, key=lambda x: (x[0], -x[1]))


def alternatives(route: WorkerRoute, worker: WorkerView, prompt_len: int, max_new: int, now: float) -> list[Candidate]:
    """Every feasible boundary candidate of one worker at ``now``, lowest score first."""
    return [r.best for r in alternative_routes(route, worker, prompt_len, max_new, now)]


def alternative_routes(
    route: WorkerRoute, worker: WorkerView, prompt_len: int, max_new: int, now: float
) -> list[WorkerRoute]:
    """Every feasible boundary of one worker at ``now`` as a lazy route, lowest score first; among equal
    scores the longer route first (candidates are built only when read; a decision record ships their
    inputs). Scores from planning are reused while nothing they read has changed."""
    base_queue, lower_load = queue_of(worker, now), lower_load_of(worker, now)
    scored = route.feasible
    if scored is None or route.planned_for != _planned_for(worker, prompt_len, max_new, base_queue, lower_load):
        scored = _evaluate(
            worker, route.bounds, prompt_len, max_new, route.chunk_tokens, base_queue, lower_load, route.scoring
        )
    return [route.at(i, score, base_queue, lower_load) for score, i in _by_rank(scored)]


def _planned_for(
    worker: WorkerView, prompt_len: int, max_new: int, base_queue: float, lower_load: float
) -> tuple[object, ...]:
    """Everything ``_evaluate`` reads of a worker and a request besides the route and its scoring."""
    load = worker.load
    return (worker.heartbeat, load.pages_held, prompt_len, max_new, base_queue, lower_load)


SharedRoute = tuple[tuple[RouteSegment, ...], list[Boundary]]


def shared_route(runs: Sequence[Run], index: ResidencyIndex, chunk_tokens: int) -> tuple[SharedRoute, int]:
    """The route of a worker holding no local copy, with its boundaries, and the OR of the runs' values."""
    present = 0
    for value, _ in runs:
        present |= value
    segments = walk_route(runs, index, None, 0, True, True) if runs else ()
    return (segments, boundaries_of(segments, chunk_tokens)), present


def route_for(
    request_model: str,
    prompt_len: int,
    max_new: int,
    runs: Sequence[Run],
    chain_fingerprint: bytes,
    chunk_tokens: int,
    worker: WorkerView,
    index: ResidencyIndex,
    excluded_pairs: frozenset[tuple[str, str]] | set[tuple[str, str]],
    shared: SharedRoute,
    present: int,
    now: float,
    scoring: Scoring,
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
        allowed, allow_peer, allow_object = LOCAL_MASK | (PENDING if scoring.pending else 0), True, True
        if excluded_pairs:
            for tier, bit in (("gpu", GPU | PENDING), ("ram", RAM), ("ssd", SSD)):
                if (wid, tier) in excluded_pairs:
                    allowed &= ~bit
            allow_peer = (wid, "peer") not in excluded_pairs
            allow_object = (wid, "object") not in excluded_pairs
        shift = index.shift_of(wid)
        local = shift is not None and (present >> shift) & (LOCAL_MASK | PENDING)
        if not local and allow_peer and allow_object:
            segments, bounds = shared
        else:
            segments = walk_route(runs, index, shift, allowed, allow_peer, allow_object)
            bounds = boundaries_of(segments, chunk_tokens)
    base_queue, lower_load = queue_of(worker, now), lower_load_of(worker, now)
    scored = _evaluate(worker, bounds, prompt_len, max_new, chunk_tokens, base_queue, lower_load, scoring)
    if not scored:
        return None
    best_t, best_i = scored[0]
    for t, i in scored:  # the lowest score; among equal scores the longest route
        if t <= best_t:
            best_t, best_i = t, i
    route = WorkerRoute(
        worker, segments, bounds, best_t, best_i, prompt_len, chunk_tokens, now, scoring, base_queue, lower_load
    )
    route.feasible = scored
    route.planned_for = _planned_for(worker, prompt_len, max_new, base_queue, lower_load)
    return route


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
    runs = index.runs(chain)
    result = Plan(available_chunks=sum(n for _, n in runs))
    shared, present = shared_route(runs, index, chunk_tokens)
    need = prompt_len + max_new
    for worker in workers:
        hb = worker.heartbeat
        wid = hb.worker_id
        if wid in excluded_workers:
            result.excluded[wid] = exclusions.FAILED_BEFORE
        elif request_model not in hb.models:
            result.excluded[wid] = exclusions.model_not_served(request_model)
        elif need > hb.context_limit:
            result.excluded[wid] = exclusions.context_limit(hb.context_limit, need)
        else:
            route = route_for(
                request_model,
                prompt_len,
                max_new,
                runs,
                chain_fingerprint,
                chunk_tokens,
                worker,
                index,
                excluded_pairs,
                shared,
                present,
                now,
                scoring,
            )
            if route is None:
                result.excluded[wid] = exclusions.CAPACITY
            else:
                result.routes.append(route)
    return result
