"""Live workers grouped by what their routes cost, each group kept in queue order, and planning over them.

Two workers with the same models, context limit, rates, chunk size and
fingerprints cost the same to serve a request from anything but their own
local copies; only their queues (and capacity) tell them apart. ``Roster``
keeps such workers in one ``Group`` whose members are sorted by queue (the
larger of the reported queue and the router's own outstanding estimate), and
``plan_pruned`` plans only the workers that hold a local copy of the chain plus,
per group, the least-queued workers until a lower bound on their score exceeds
the best candidate found. It returns the same best candidate as
``candidates.plan`` over every worker, at a cost that does not grow with the
number of workers that cannot win.

Contract: the roster's members are exactly the router's live views;
``requeue`` is called whenever a member's ``queue_of`` may have changed
(``WorkerLoad.outstanding_s`` written), ``put`` on every new heartbeat view,
``remove`` when a worker is fenced.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections.abc import Container, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from kvrelay.core.planning import candidates as cand
from kvrelay.core.planning import exclusions, predicted_ttft
from kvrelay.core.planning.index import ResidencyIndex

GroupKey = tuple[frozenset[str], int, tuple[float, int, float, float], int, frozenset[tuple[str, bytes]]]
Entry = tuple[float, str]
"""``(queue + one decode step in seconds, worker id)``: a group's order; every candidate waits at least this."""


def group_key(view: predicted_ttft.WorkerView) -> GroupKey:
    hb = view.heartbeat
    return (
        frozenset(hb.models),
        hb.context_limit,
        view.signature,
        hb.chunk_tokens,
        frozenset(view.fingerprints.items()),
    )


@dataclass(slots=True)
class Group:
    key: GroupKey
    views: dict[str, predicted_ttft.WorkerView] = field(default_factory=dict)
    order: list[Entry] = field(default_factory=list)
    """Members by (wait, worker id), ascending."""


class Roster:
    def __init__(self) -> None:
        self.groups: dict[GroupKey, Group] = {}
        self._placed: dict[str, tuple[Group, Entry]] = {}
        self._busy: set[str] = set()
        """Members whose queue is not empty."""

    def __len__(self) -> int:
        return len(self._placed)

    def busy_share(self) -> float:
        """The share of members with prompt work queued (``prompt_queue_of``; 0 with no members): requests
        running there, however a worker prices them, do not make it busy, as a native worker's decoding lanes
        do not."""
        return len(self._busy) / len(self._placed) if self._placed else 0.0

    def work_s_per_token(self) -> float:
        """Prefill seconds per token of the members' mean rate: ``n / sum(1 / prefill_s_per_token)`` (0 with no
        members, or when a member reports no rate). Adding a token of work anywhere delays the fleet's
        backlog by about this much per worker, whichever worker computes it (``Scoring.work_s_per_token``).
        When every member reports the same rate, it is that rate exactly."""
        rates = [(len(g.views), g.key[2][0]) for g in self.groups.values()]
        if not rates or any(p <= 0.0 for _, p in rates):
            return 0.0
        first = rates[0][1]
        if all(p == first for _, p in rates):
            return first
        return sum(n for n, _ in rates) / sum(n / p for n, p in rates)

    def _mark(self, view: predicted_ttft.WorkerView) -> None:
        if predicted_ttft.prompt_queue_of(view) > 0.0:
            self._busy.add(view.heartbeat.worker_id)
        else:
            self._busy.discard(view.heartbeat.worker_id)

    def view(self, worker_id: str) -> predicted_ttft.WorkerView | None:
        placed = self._placed.get(worker_id)
        return None if placed is None else placed[0].views[worker_id]

    def put(self, view: predicted_ttft.WorkerView) -> None:
        """Add ``view`` or replace its worker's previous view (a new heartbeat)."""
        wid = view.heartbeat.worker_id
        key = group_key(view)
        placed = self._placed.get(wid)
        if placed is not None and placed[0].key != key:
            self.remove(wid)
            placed = None
        group = placed[0] if placed is not None else self.groups.get(key)
        if group is None:
            group = self.groups[key] = Group(key)
        group.views[wid] = view
        if placed is None:
            entry = (_wait_of(view), wid)
            insort(group.order, entry)
            self._placed[wid] = (group, entry)
            self._mark(view)
        else:
            self.requeue(view)

    def requeue(self, view: predicted_ttft.WorkerView) -> None:
        """Move a member to its place after its queue changed."""
        wid = view.heartbeat.worker_id
        group, old = self._placed[wid]
        new = (_wait_of(view), wid)
        self._mark(view)
        if new == old:
            return
        del group.order[bisect_left(group.order, old)]
        insort(group.order, new)
        self._placed[wid] = (group, new)

    def least_queue(self, model: str, need: int, skip: Container[str]) -> float:
        """The shortest queue (``queue_of``) of a member that serves ``model`` with a context of at least ``need``
        tokens, leaving out ``skip``; inf when there is none. Members are taken in their group's order."""
        best = math.inf
        for group in self.groups.values():
            models, context_limit = group.key[0], group.key[1]
            if model not in models or need > context_limit:
                continue
            for _, wid in group.order:
                if wid not in skip:
                    best = min(best, predicted_ttft.queue_of(group.views[wid], 0.0))
                    break
        return best

    def remove(self, worker_id: str) -> None:
        placed = self._placed.pop(worker_id, None)
        if placed is None:
            return
        group, entry = placed
        self._busy.discard(worker_id)
        del group.order[bisect_left(group.order, entry)]
        del group.views[worker_id]
        if not group.views:
            del self.groups[group.key]


class PrunedBounds(Mapping[str, float]):
    """Worker id -> the lower bound on its score, for the workers ``plan_pruned`` skipped.

    Holds the skipped tails of the groups' queue orders (copies) and builds the
    mapping on first read: most plans' pruned workers are never looked at.
    """

    __slots__ = ("_bounds", "_parts")

    def __init__(self) -> None:
        self._parts: list[tuple[list[Entry], float, set[str]]] = []
        self._bounds: dict[str, float] | None = None

    def add(self, entries: list[Entry], intrinsic: float, planned_apart: set[str]) -> None:
        """Each ``(wait, worker)`` of ``entries`` not in ``planned_apart`` was skipped with bound wait + intrinsic."""
        self._parts.append((entries, intrinsic, planned_apart))
        self._bounds = None

    def _built(self) -> dict[str, float]:
        if self._bounds is None:
            self._bounds = {
                w: q + intrinsic for entries, intrinsic, apart in self._parts for q, w in entries if w not in apart
            }
        return self._bounds

    def __getitem__(self, worker_id: str) -> float:
        return self._built()[worker_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._built())

    def __len__(self) -> int:
        return len(self._built())

    def __repr__(self) -> str:
        return f"PrunedBounds({self._built()!r})"


def _wait_of(view: predicted_ttft.WorkerView) -> float:
    return predicted_ttft.queue_of(view, 0.0) + view.heartbeat.decode_s_per_token


def _holders(present: int, index: ResidencyIndex) -> list[str]:
    """Workers with a local tier bit in ``present`` (an OR of packed index values), lowest slot first."""
    out: list[str] = []
    bits = present >> 4
    while bits:
        slot = ((bits & -bits).bit_length() - 1) >> 2
        out.append(index.workers_by_slot[slot])
        bits &= ~(0xF << (4 * slot))
    return out


def plan_pruned(
    request_model: str,
    prompt_len: int,
    max_new: int,
    chain: Sequence[bytes],
    chain_fingerprint: bytes,
    chunk_tokens: int,
    roster: Roster,
    index: ResidencyIndex,
    excluded_workers: frozenset[str] | set[str] = frozenset(),
    excluded_pairs: frozenset[tuple[str, str]] | set[tuple[str, str]] = frozenset(),
    now: float = 0.0,
    scoring: predicted_ttft.Scoring = predicted_ttft.PREDICTED_TTFT,
) -> cand.Plan:
    """The plan of ``candidates.plan`` restricted to the workers that can still win (see the module docstring).

    ``Plan.best()`` equals that of ``candidates.plan`` over the roster's views. Workers of
    groups that do not serve the model or whose context is too short are listed in
    ``Plan.excluded``; skipped workers are listed in ``Plan.pruned`` with their bound.
    When nothing is feasible the result is the full plan, which names every exclusion.
    """
    pruned = PrunedBounds()
    runs = index.runs(chain)
    result = cand.Plan(pruned=pruned, available_chunks=sum(n for _, n in runs))
    shared, present = cand.shared_route(runs, index, chunk_tokens)
    need = prompt_len + max_new
    best, best_id = float("inf"), ""

    def plan_worker(view: predicted_ttft.WorkerView) -> None:
        """Plan one eligible worker into ``result``, keeping the best (score, id) so far."""
        nonlocal best, best_id
        wid = view.heartbeat.worker_id
        if wid in excluded_workers:
            result.excluded[wid] = exclusions.FAILED_BEFORE
            return
        route = cand.route_for(
            request_model,
            prompt_len,
            max_new,
            runs,
            chain_fingerprint,
            chunk_tokens,
            view,
            index,
            excluded_pairs,
            shared,
            present,
            now,
            scoring,
        )
        if route is None:
            result.excluded[wid] = exclusions.CAPACITY
            return
        result.routes.append(route)
        if (route.best_score, wid) < (best, best_id):
            best, best_id = route.best_score, wid

    local = _holders(present, index)
    for wid in local:
        view = roster.view(wid)
        if view is not None and request_model in view.heartbeat.models and need <= view.heartbeat.context_limit:
            plan_worker(view)  # otherwise its group names the reason
    local_set = set(local)
    for group in roster.groups.values():
        models, context_limit, _, group_chunk_tokens, fingerprints = group.key
        if request_model not in models:
            result.excluded.update(dict.fromkeys(group.views, exclusions.model_not_served(request_model)))
            continue
        if need > context_limit:
            result.excluded.update(dict.fromkeys(group.views, exclusions.context_limit(context_limit, need)))
            continue
        first = group.views[group.order[0][1]]
        exact = dict(fingerprints).get(request_model) == chain_fingerprint and group_chunk_tokens == chunk_tokens
        if exact and runs:
            intrinsic = cand.intrinsic_cost(first.heartbeat, shared[1], prompt_len, chunk_tokens, scoring)
        else:
            intrinsic = prompt_len * predicted_ttft.score_per_token(first.heartbeat, scoring)
        for i, (wait, wid) in enumerate(group.order):
            if (wait + intrinsic, wid) > (best, best_id):  # neither this worker nor any after it can win
                pruned.add(group.order[i:], intrinsic, local_set)
                break
            if wid not in local_set:
                plan_worker(group.views[wid])
    if not result.routes:
        views = [v for g in roster.groups.values() for v in g.views.values()]
        return cand.plan(
            request_model,
            prompt_len,
            max_new,
            chain,
            chain_fingerprint,
            chunk_tokens,
            views,
            index,
            excluded_workers,
            excluded_pairs,
            now,
            scoring,
        )
    return result
