"""Prometheus metrics read from the router's state: decisions, declines, retries, stale messages, the reuse
available, captured by the routing and delivered by the workers (``core.router.reuse``), and what each live
worker's last heartbeat says of its pages and chunk store.

Counters come from ``RouterState.counters`` (the pure router counts; nothing
here counts twice); per-worker gauges come from heartbeats, so they are as
fresh as the last heartbeat (0.5 s by default). Both are read at scrape time
by ``RouterCollector``.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvrelay.api.metrics import Metrics
from kvrelay.core.router.reuse import reuse_figures
from kvrelay.router.cluster_router import ClusterRouter

OUTCOME_COUNTERS = {
    "accepted": "accepted",
    "declined": "declines",
    "timed_out": "offer_timeouts",
    "worker_lost": "worker_lost_assignments",
    "no_progress": "progress_timeouts",
}
PAGE_STATES = ("free", "cached", "in_use", "reserved")


class RouterCollector:
    """Yields the router's series from ``router.state`` at each scrape (``worker_pages``: also the page gauges)."""

    def __init__(self, router: ClusterRouter, worker_pages: bool) -> None:
        self.router = router
        self.worker_pages = worker_pages

    def collect(self) -> Iterator[Metric]:
        counters = self.router.state.counters
        decisions = CounterMetricFamily(
            "kvrelay_routing_decisions_total", "offers sent, and how they ended", labels=["outcome"]
        )
        for outcome, counter in OUTCOME_COUNTERS.items():
            decisions.add_metric([outcome], counters.get(counter, 0))
        decisions.add_metric(["offered"], counters.get("offers", 0))
        yield decisions
        yield _by_prefix(counters, "kvrelay_declines_total", "declined offers by reason", "declined_", "reason")
        yield CounterMetricFamily("kvrelay_retries_total", "attempts after the first", value=counters.get("retries", 0))
        yield CounterMetricFamily(
            "kvrelay_stale_messages_dropped_total",
            "messages of a stale attempt, dropped",
            value=counters.get("stale_dropped", 0),
        )
        yield _by_prefix(
            counters, "kvrelay_requests_finished_total", "requests ended, by finish reason", "finished_", "reason"
        )
        reuse = reuse_figures(counters)
        for figure, value, help_ in (
            ("available", reuse.available_tokens, "longest prefix held anywhere, per attempt routed"),
            ("captured", reuse.captured_tokens, "cached tokens of the chosen route, per attempt routed"),
            ("delivered", reuse.delivered_tokens, "cached tokens the workers restored or found, per result"),
        ):
            yield CounterMetricFamily(
                f"kvrelay_reuse_{figure}_tokens", f"prompt tokens of reuse {figure}: {help_}", value=value
            )
        yield GaugeMetricFamily(
            "kvrelay_router_queue_requests", "requests waiting in the router queue", value=self.router.state.queued()
        )
        yield CounterMetricFamily(
            "kvrelay_router_queue_waits_total",
            "times a request began to wait in the router queue",
            value=counters.get("queued", 0),
        )
        yield CounterMetricFamily(
            "kvrelay_router_queue_refused_total",
            "new requests refused at a router queue bound (429)",
            value=counters.get("queue_refused", 0),
        )
        views = self.router.state.views
        yield GaugeMetricFamily("kvrelay_workers_live", "live workers", value=len(views))
        if self.worker_pages:
            pages = {
                state: GaugeMetricFamily(
                    f"kvrelay_pages_{state}",
                    f"pages {state.replace('_', ' ')} per worker, from its last heartbeat",
                    labels=["worker"],
                )
                for state in PAGE_STATES
            }
            for wid, view in sorted(views.items()):
                hb = view.heartbeat
                in_use = max(0, hb.pages_total - hb.pages_free - hb.pages_evictable - hb.pages_reserved)
                for state, value in (
                    ("free", hb.pages_free),
                    ("cached", hb.pages_evictable),
                    ("in_use", in_use),
                    ("reserved", hb.pages_reserved),
                ):
                    pages[state].add_metric([wid], value)
            yield from pages.values()
        store = GaugeMetricFamily(
            "kvrelay_chunk_store_bytes",
            "bytes held per chunk tier per worker, from its last heartbeat",
            labels=["worker", "tier"],
        )
        for wid, view in sorted(views.items()):
            for tier, n in sorted(view.heartbeat.chunk_bytes_by_tier.items()):
                store.add_metric([wid, tier], n)
        yield store


def _by_prefix(counters: dict[str, int], name: str, help_: str, prefix: str, label: str) -> CounterMetricFamily:
    family = CounterMetricFamily(name, help_, labels=[label])
    for key, value in sorted(counters.items()):
        if key.startswith(prefix):
            family.add_metric([key[len(prefix) :]], value)
    return family


def add_router_metrics(metrics: Metrics, router: ClusterRouter, worker_pages: bool = True) -> None:
    """Register the router's series on ``metrics`` (``worker_pages``: also the per-worker page gauges)."""
    metrics.registry.register(RouterCollector(router, worker_pages))
