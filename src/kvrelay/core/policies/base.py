"""The routing policy interface.

A policy picks one worker for a request from the planned candidates. It sees
the ``RoutingContext`` (the request's chain, every eligible worker's longest
reachable route, its best candidate and its observations) and returns the
``Candidate`` to offer, or None when it declines to choose. A policy is
deterministic: any randomness comes from ``ctx.rng``, seeded in the router
state. ``on_routed`` lets stateful policies (round-robin's cursor, SGLang's
approximate tree) learn the choice; it is called exactly once per offer sent.
``priority`` sets the offer's place in the chosen worker's prefill queue
(``Offer.priority``); the peers' published policies set none (0: FIFO).
``hold_order`` orders a user's requests while they wait in the router queue, with one key for usual
times and one for a long backlog on a cluster that is not overloaded (``router.offered_load``).
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import NamedTuple

from kvrelay.core.planning.candidates import Plan, WorkerRoute
from kvrelay.core.planning.predicted_ttft import Candidate, WorkerView
from kvrelay.core.router.events import Request
from kvrelay.core.router.queue import HoldOrder


class RoutingContext(NamedTuple):
    request: Request
    prompt: tuple[int, ...]
    chain: tuple[bytes, ...]
    chunk_tokens: int
    plan: Plan
    workers: dict[str, WorkerView]
    rng: random.Random
    now: float
    arrived: float
    """When the request reached the router (the same for every attempt)."""
    busy_share: float = 0.0
    """The share of live workers with a non-empty queue (``Roster.busy_share``) when the plan was made."""

    @property
    def routes(self) -> Sequence[WorkerRoute]:
        return self.plan.routes


class Policy(ABC):
    name: str = "abstract"
    needs_all_routes: bool = True
    """False when the policy only ever takes the lowest score, so planning may prune."""
    work_weight: float = 0.0
    """How much a candidate's prefill seconds add to its score, times the share of workers with a queue
    (``candidates.Scoring``); 0: the score is the TTFT."""
    interleave_below_busy_share: float = 0.0
    """Count the decode steps interleaved with a prefill (``candidates.Scoring.interleave``) while fewer
    than this share of workers have a queue; 0: never."""
    predicts_on_route: bool = False
    """Credit the chosen worker with the request's chunks as pending, and count pending chunks as cached on
    their worker when planning (``planning.pending``, ``candidates.Scoring.pending``)."""

    @abstractmethod
    def choose(self, ctx: RoutingContext) -> Candidate | None:
        """The candidate to offer among ``ctx.routes`` (each worker's alternatives), or None."""

    def priority(self, ctx: RoutingContext, chosen: Candidate) -> float:
        """The ``Offer.priority`` of an offer of ``chosen`` (default 0: every worker queue is FIFO)."""
        return 0.0

    def hold_order(self, arrived: float, work_s: float) -> HoldOrder:
        """The keys that order one user's requests waiting in the router queue, lower first (``router.queue``):
        ``arrived`` is when the request reached the router, ``work_s`` its predicted prefill seconds
        (default: arrival, FIFO, in either regime)."""
        return HoldOrder.of(arrived)

    def on_routed(self, ctx: RoutingContext, chosen: Candidate) -> None:  # noqa: B027 (an optional hook)
        """Learn that ``chosen`` was offered (default: nothing to learn)."""
