"""The ingress's Prometheus metrics: one ``prometheus_client`` registry per app.

``Metrics`` owns a ``CollectorRegistry`` of its own (never the process-wide
default one: several apps may live in one process); ``/metrics`` renders it
with ``generate_latest``. What the ingress counts itself are ``prometheus_client``
counters and histograms (``IngressSeries``). Values kept elsewhere are read at
scrape time: by collectors registered on ``Metrics.registry`` (the router's,
in ``api.router_metrics``) or by callables registered with ``Metrics.gauge``,
so a scrape always shows current values and nothing is counted twice.

Expositions carry no ``_created`` series; that is a process-wide setting of
``prometheus_client``, turned off when this module is imported.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from kvrelay.protocol.messages import CACHE_TIERS

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
Labels = tuple[tuple[str, str], ...]
Read = Callable[[], dict[Labels, float]]
"""Series read at scrape time: value by label pairs (the same label names in every key)."""

disable_created_metrics()


@dataclass(frozen=True, slots=True)
class ReadGauge:
    name: str
    help: str
    read: Read

    def family(self) -> GaugeMetricFamily:
        family = GaugeMetricFamily(self.name, self.help)
        for labels, value in sorted(self.read().items()):
            family.add_sample(self.name, dict(labels), value)
        return family


class ReadGauges:
    """A collector of the gauges registered with ``Metrics.gauge``: one family per name, in name order."""

    def __init__(self) -> None:
        self.gauges: dict[str, ReadGauge] = {}

    def collect(self) -> Iterator[Metric]:
        for name in sorted(self.gauges):
            yield self.gauges[name].family()


class Metrics:
    """One app's registry: the ingress's own series plus whatever is registered to be read at scrape time."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._gauges = ReadGauges()
        self.registry.register(self._gauges)

    def gauge(self, name: str, read: Read, help_: str = "") -> None:
        """A gauge whose series ``read`` returns at each scrape; registering a name again replaces it."""
        self._gauges.gauges[name] = ReadGauge(name, help_, read)


@dataclass(frozen=True, slots=True)
class IngressSeries:
    """The series the ingress counts itself, registered on one registry (once per registry)."""

    requests: Counter
    """Requests submitted, by ``model``."""
    errors: Counter
    """Requests that failed, by ``reason``."""
    cached_tokens: Counter
    """Prompt tokens served from cache, by ``tier``."""
    recomputed_tokens: Counter
    disconnects: Counter
    ttft: Histogram
    inter_token: Histogram

    @classmethod
    def register(cls, registry: CollectorRegistry) -> IngressSeries:
        series = cls(
            requests=Counter("kvrelay_requests_total", "requests submitted", ["model"], registry=registry),
            errors=Counter("kvrelay_request_errors_total", "requests that failed", ["reason"], registry=registry),
            cached_tokens=Counter(
                "kvrelay_cached_tokens_total", "prompt tokens served from cache", ["tier"], registry=registry
            ),
            recomputed_tokens=Counter("kvrelay_recomputed_tokens_total", "prompt tokens computed", registry=registry),
            disconnects=Counter(
                "kvrelay_client_disconnects_total", "requests cancelled by their client", registry=registry
            ),
            ttft=Histogram("kvrelay_ttft_seconds", "time to first token", buckets=LATENCY_BUCKETS, registry=registry),
            inter_token=Histogram(
                "kvrelay_inter_token_seconds", "time between tokens", buckets=LATENCY_BUCKETS, registry=registry
            ),
        )
        for tier in CACHE_TIERS:  # their kvrelay_cached_tokens_total series exist from the start
            series.cached_tokens.labels(tier=tier)
        return series
