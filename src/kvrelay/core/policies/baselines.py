"""Baselines: round-robin and least-loaded, each offering its worker's cheapest route."""

from __future__ import annotations

from kvrelay.core.planning.predicted_ttft import Candidate
from kvrelay.core.policies.base import Policy, RoutingContext


class RoundRobin(Policy):
    """Workers in id order, one after another, skipping those that cannot take the request."""

    name = "round_robin"

    def __init__(self) -> None:
        self._cursor = 0
        self._order: list[str] = []

    def choose(self, ctx: RoutingContext) -> Candidate | None:
        if not ctx.routes:
            return None
        eligible = {r.worker_id: r for r in ctx.routes}
        order = sorted(set(self._order) | set(ctx.workers))
        self._order = order
        for i in range(len(order)):
            wid = order[(self._cursor + i) % len(order)]
            if wid in eligible:
                return eligible[wid].best
        return None

    def on_routed(self, ctx: RoutingContext, chosen: Candidate) -> None:
        self._cursor = (self._order.index(chosen.worker_id) + 1) % len(self._order)


class LeastLoaded(Policy):
    """The worker with the fewest active assignments (then most free pages, then id)."""

    name = "least_loaded"

    def choose(self, ctx: RoutingContext) -> Candidate | None:
        if not ctx.routes:
            return None

        def load(route_worker: str) -> tuple[int, int, str]:
            view = ctx.workers[route_worker]
            return (
                view.load.active + view.heartbeat.active_lanes,
                -(view.heartbeat.pages_free - view.load.pages_held),
                route_worker,
            )

        return min(ctx.routes, key=lambda r: load(r.worker_id)).best
