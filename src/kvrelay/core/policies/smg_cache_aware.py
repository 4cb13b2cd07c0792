"""SGLang Model Gateway (smg) ``cache_aware``, at its current version: the approximate tree and the KV-event mode.

Source followed (read, not copied): lightseekorg/smg at commit 73da68ca
(2026-08-07), ``model_gateway/src/policies/cache_aware.rs``:

- ``select_worker``: over the healthy workers, gather each one's load (the
  gateway's own in-flight request count) and the min-load worker, ordered by
  ``(load, processed requests, index)``. When the pool is imbalanced
  (``max - min > balance_abs_threshold`` and ``max > min *
  balance_rel_threshold``; the KV-usage triggers are off by default) the
  min-load worker wins.
- Approximate tree (HTTP and gRPC without KV events; ``select_worker_with_text``
  and ``select_worker_with_tokens``): one descent matches the request and picks
  a worker: when ``matched / input > cache_threshold`` the tenant of the deepest
  matched node (``kv_index`` ``string_tree.rs`` ``resolve_tenant_readonly``: the
  node's last tenant, the one that inserted there most recently); otherwise the
  min-load worker. The request is inserted under the chosen worker either way.
  This is the change from sgl-router's policy (``sglang_cache_aware``), which
  sent a miss to the worker with the smallest tree.
- KV-event mode (gRPC workers with KV events; ``select_worker_event_driven``,
  ``score_overlap``): the overlap of the request's blocks with each worker's
  device cache (``PositionalIndexer``, fed by the engines' KV events) decides:
  the highest overlap wins, ties to the lower load, then the smaller indexed
  size; with no overlap anywhere, the min-load worker. No threshold.
- Defaults: ``model_gateway/src/main.rs`` (the ``smg`` CLI): ``cache_threshold``
  0.3, ``balance_abs_threshold`` 64, ``balance_rel_threshold`` 1.5,
  ``eviction_interval`` 120 s, ``max_tree_size`` 2**26; smg 1.13.0's Python
  launcher (``smg/router_args.py``) has the same. ``CacheAwareConfig::default()``
  in ``policies/mod.rs`` has other values (0.5, 32, 1.1, 30 s, 10,000): a
  gateway built from code without them gets those. We take the CLI's, which a
  deployment started with ``smg launch`` runs.

Adaptations, each keeping what the real gateway sees: the tree holds token ids
(the gRPC token tree; the HTTP one holds characters); time is the router's
logical clock; healthy workers are the eligible routes; in KV-event mode the
overlap is the worker's own leading device (``gpu``) chunks from residency
events and the indexed size is the pages the worker's last heartbeat shows in
use. It never reads pending credits. The chosen worker is offered its cheapest
route (``route.best``), as for every policy, so the comparison is of worker
selection alone.
"""

from __future__ import annotations

from kvrelay.core.planning.candidates import WorkerRoute
from kvrelay.core.planning.predicted_ttft import Candidate
from kvrelay.core.policies.base import Policy, RoutingContext
from kvrelay.core.policies.sglang_cache_aware import ApproximateTree


class _GatewayLoads:
    """The gateway's view of load: in-flight requests per worker and requests it routed there."""

    def __init__(self, balance_abs_threshold: int, balance_rel_threshold: float) -> None:
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.processed: dict[str, int] = {}

    def loads(self, ctx: RoutingContext, routes: list[WorkerRoute]) -> dict[str, int]:
        return {r.worker_id: ctx.workers[r.worker_id].load.active for r in routes}

    def imbalanced(self, loads: dict[str, int]) -> bool:
        high, low = max(loads.values()), min(loads.values())
        return high - low > self.balance_abs_threshold and high > low * self.balance_rel_threshold

    def min_load(self, loads: dict[str, int], routes: list[WorkerRoute]) -> WorkerRoute:
        """The worker with the fewest in-flight requests, then the fewest routed, then the lowest index."""
        return min(routes, key=lambda r: (loads[r.worker_id], self.processed.get(r.worker_id, 0), r.worker_id))

    def routed(self, worker_id: str) -> None:
        self.processed[worker_id] = self.processed.get(worker_id, 0) + 1


class SmgCacheAware(Policy):
    """smg ``cache_aware`` with its approximate tree (no KV events)."""

    name = "smg_cache_aware"

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        eviction_interval_s: float = 120.0,
        max_tree_size: int = 2**26,
    ) -> None:
        self.cache_threshold = cache_threshold
        self.gateway = _GatewayLoads(balance_abs_threshold, balance_rel_threshold)
        self.eviction_interval_s = eviction_interval_s
        self.max_tree_size = max_tree_size
        self.tree = ApproximateTree()
        self._last_eviction: float | None = None

    def choose(self, ctx: RoutingContext) -> Candidate | None:
        routes = sorted(ctx.routes, key=lambda r: r.worker_id)
        if not routes:
            return None
        loads = self.gateway.loads(ctx, routes)
        if self.gateway.imbalanced(loads):
            return self.gateway.min_load(loads, routes).best
        matched, tenant = self.tree.deepest_tenant(ctx.prompt)
        if not (ctx.prompt and matched / len(ctx.prompt) > self.cache_threshold):
            return self.gateway.min_load(loads, routes).best
        by_id = {r.worker_id: r for r in routes}
        return (by_id[tenant] if tenant in by_id else routes[0]).best  # a gone tenant: the first healthy worker

    def on_routed(self, ctx: RoutingContext, chosen: Candidate) -> None:
        self.gateway.routed(chosen.worker_id)
        self.tree.insert(ctx.prompt, chosen.worker_id, ctx.now)
        if self._last_eviction is None:
            self._last_eviction = ctx.now
        elif ctx.now - self._last_eviction >= self.eviction_interval_s:
            self.tree.evict(self.max_tree_size)
            self._last_eviction = ctx.now


def device_overlap(route: WorkerRoute) -> int:
    """The worker's own leading device chunks of the request (what its KV events report)."""
    first = route.segments[0] if route.segments else None
    return first.chunks if first is not None and first.tier == "gpu" and not first.source else 0


class SmgKvEvents(Policy):
    """smg ``cache_aware`` in its KV-event mode: the device overlap decides, no threshold."""

    name = "smg_kv_events"

    def __init__(self, balance_abs_threshold: int = 64, balance_rel_threshold: float = 1.5) -> None:
        self.gateway = _GatewayLoads(balance_abs_threshold, balance_rel_threshold)

    def choose(self, ctx: RoutingContext) -> Candidate | None:
        routes = sorted(ctx.routes, key=lambda r: r.worker_id)
        if not routes:
            return None
        loads = self.gateway.loads(ctx, routes)
        if self.gateway.imbalanced(loads):
            return self.gateway.min_load(loads, routes).best
        overlaps = {r.worker_id: device_overlap(r) for r in routes}
        if max(overlaps.values()) == 0:
            return self.gateway.min_load(loads, routes).best

        def rank(r: WorkerRoute) -> tuple[int, int, int, str]:
            hb = ctx.workers[r.worker_id].heartbeat
            indexed = hb.pages_total - hb.pages_free
            return (-overlaps[r.worker_id], loads[r.worker_id], indexed, r.worker_id)

        return min((r for r in routes if overlaps[r.worker_id] > 0), key=rank).best

    def on_routed(self, ctx: RoutingContext, chosen: Candidate) -> None:
        self.gateway.routed(chosen.worker_id)
