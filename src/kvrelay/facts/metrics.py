"""The fact store's Prometheus series, read from ``FactStore.stats()`` at each scrape.

- ``kvrelay_facts_written_total``: records written to the database.
- ``kvrelay_facts_lost_total{reason}``: records that will never be written, by why: ``dropped`` (the writer
  gave up after its retries: the database is down, full or read-only), ``overflow`` (the bounded buffer was
  full), ``rejected`` (malformed, or refused by the database), ``unknown_kind``, ``closed`` (submitted after
  the store closed). Every reason has a series from the start, so an alert on any rise works at once.
- ``kvrelay_facts_write_failures_total``: failed write attempts (each is retried, up to the writer's limit).
- ``kvrelay_facts_pending``: records accepted and not yet written, rejected or dropped.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvrelay.facts.store import FactStore, FactStoreStats

LOST_REASONS: dict[str, str] = {
    "dropped": "dropped",
    "overflow": "overflow",
    "rejected": "rejected",
    "unknown_kind": "unknown_kinds",
    "closed": "closed_drops",
}
"""The ``reason`` label of ``kvrelay_facts_lost_total`` -> the ``FactStoreStats`` field it reads."""


class FactStoreCollector:
    """Yields the store's series (see the module docstring) from one ``stats()`` call per scrape."""

    def __init__(self, store: FactStore) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        stats: FactStoreStats = self.store.stats()
        yield CounterMetricFamily("kvrelay_facts_written", "fact records written", value=stats.written)
        lost = CounterMetricFamily(
            "kvrelay_facts_lost",
            "fact records that will never be written, by reason (dropped: the writer gave up after its retries, "
            "e.g. the database is down or its disk is full; overflow: the buffer was full)",
            labels=["reason"],
        )
        for reason, field in LOST_REASONS.items():
            lost.add_metric([reason], getattr(stats, field))
        yield lost
        yield CounterMetricFamily(
            "kvrelay_facts_write_failures",
            "failed fact write attempts (each retried up to the writer's limit)",
            value=stats.failed_attempts,
        )
        yield GaugeMetricFamily(
            "kvrelay_facts_pending",
            "fact records accepted and not yet written, rejected or dropped",
            value=stats.pending,
        )
