"""Prometheus metrics read from the router's state: decisions, declines, retries, stale messages, and
what each live worker's last heartbeat says of its pages and chunk store.

Counters come from ``RouterState.counters`` (the pure router counts; nothing
here counts twice); per-worker gauges come from heartbeats, so they are as
fresh as the last heartbeat (0.5 s by default).
"""

from __future__ import annotations

from kvrelay.api.metrics import Labels, Metrics
from kvrelay.router.cluster_router import ClusterRouter

OUTCOME_COUNTERS = {"accepted": "accepted", "declined": "declines", "timed_out": "offer_timeouts",
                    "worker_lost": "worker_lost_assignments", "no_progress": "progress_timeouts"}


def add_router_metrics(metrics: Metrics, router: ClusterRouter, worker_pages: bool = True) -> None:
    """Register the router's gauges on ``metrics`` (``worker_pages``: also the per-worker page gauges)."""

    def counters() -> dict[str, int]:
        return router.state.counters

    def by_prefix(prefix: str, label: str) -> dict[Labels, float]:
        return {((label, k[len(prefix):]),): v for k, v in counters().items() if k.startswith(prefix)}

    metrics.gauge("kvrelay_routing_decisions_total",
                  lambda: {(("outcome", o),): counters().get(c, 0) for o, c in OUTCOME_COUNTERS.items()}
                  | {(("outcome", "offered"),): counters().get("offers", 0)},
                  "offers sent, and how they ended", "counter")
    metrics.gauge("kvrelay_declines_total", lambda: by_prefix("declined_", "reason"), "declined offers by reason", "counter")
    metrics.gauge("kvrelay_retries_total", lambda: {(): counters().get("retries", 0)}, "attempts after the first", "counter")
    metrics.gauge("kvrelay_stale_messages_dropped_total", lambda: {(): counters().get("stale_dropped", 0)},
                  "messages of a stale attempt, dropped", "counter")
    metrics.gauge("kvrelay_requests_finished_total", lambda: by_prefix("finished_", "reason"),
                  "requests ended, by finish reason", "counter")
    metrics.gauge("kvrelay_workers_live", lambda: {(): len(router.state.views)}, "live workers")

    def per_worker(read: str) -> dict[Labels, float]:
        out: dict[Labels, float] = {}
        for wid, view in router.state.views.items():
            hb = view.heartbeat
            values = {"free": hb.pages_free, "cached": hb.pages_evictable, "reserved": hb.pages_reserved,
                      "in_use": max(0, hb.pages_total - hb.pages_free - hb.pages_evictable - hb.pages_reserved)}
            out[(("worker", wid),)] = values[read]
        return out

    if worker_pages:
        for state in ("free", "cached", "in_use", "reserved"):
            metrics.gauge(f"kvrelay_pages_{state}", lambda s=state: per_worker(s),
                          f"pages {state.replace('_', ' ')} per worker, from its last heartbeat")
    metrics.gauge("kvrelay_chunk_store_bytes",
                  lambda: {(("worker", w), ("tier", t)): n for w, v in router.state.views.items()
                           for t, n in v.heartbeat.chunk_bytes_by_tier.items()},
                  "bytes held per chunk tier per worker, from its last heartbeat")
