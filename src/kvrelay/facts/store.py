"""``FactStore``: facts buffered with a bound and written in batches by a writer process.

Contract:
- ``submit(record)`` and the ``record_*`` methods never block on the database
  and never raise because of it: they encode the item (``wire.encode_item``:
  a few microseconds, lazy candidates stay lazy) into a bounded buffer and
  return True, or, when ``buffer_size`` items are accepted and not yet
  processed or the store is closed, drop it, count it (``overflow`` or
  ``closed_drops``) and return False.
- The writer is a process of its own (``writer_process``, fed by
  ``writer_link``), so validation, JSON encoding and the database driver never
  hold the router's interpreter lock. It validates each item, writes batches of
  at most ``batch_size`` items in one transaction, retries database failures
  with backoff and rejects bad rows alone; its counters (``written``,
  ``rejected``, ``unknown_kinds``, ``dropped``, ``failed_attempts``,
  ``writer_busy_us``) and its log
  lines (logger ``kvrelay.facts.store``) come back to this store. A writer
  process that dies is replaced; what it held is counted in ``dropped``.
- ``flush(timeout)`` returns True once every item accepted before the call has
  been written, rejected or dropped. ``close(timeout)`` stops accepting, lets
  the writer drain what is buffered (giving up at the first failure) and
  disposes of the engine.
- The schema is created by the writer before its first write (so a store can be
  constructed while the database is down).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any

from kvrelay.core.router.events import Record
from kvrelay.facts.cache import ChainFactsCache
from kvrelay.facts.engine import default_url, make_engine
from kvrelay.facts.queries import FactReader
from kvrelay.facts.records import Fact, MalformedRecord, UnknownKind, fact_writes
from kvrelay.facts.wire import encode_item
from kvrelay.facts.writer_link import WriterLink
from kvrelay.facts.writer_process import WriterConfig

log = logging.getLogger(__name__)

CACHED_FACTS = frozenset({"lineage", "replica_stored", "replica_removed", "replica_changes"})
"""Fact kinds the routing-path cache follows."""


@dataclass(frozen=True, slots=True)
class WriterSettings:
    """Bounds of the buffer and of the writer's retries.

    ``linger_s``: the longest an item waits to be sent to the writer (``flush`` and ``close`` send at once).
    Each send and each progress report takes the interpreter lock from the routing thread for a moment, so
    fewer, larger sends keep the routing latency's tail short. ``batch_size``: the most items in one
    transaction; a writer that keeps up commits about once per ``linger_s`` (fewer commits and index page
    writes per item than with small batches); a batch a data error hits is retried row by row.
    """

    buffer_size: int = 10_000
    batch_size: int = 2000
    max_retries: int = 5
    backoff_s: float = 0.05
    backoff_max_s: float = 2.0
    linger_s: float = 0.2


@dataclass(frozen=True, slots=True)
class FactStoreStats:
    """Counters, in items (records or facts) unless named otherwise."""

    submitted: int = 0
    written: int = 0
    overflow: int = 0
    closed_drops: int = 0
    rejected: int = 0
    unknown_kinds: int = 0
    dropped: int = 0
    failed_attempts: int = 0
    writer_busy_us: int = 0
    """Microseconds the writer spent validating and writing batches (wall clock)."""
    pending: int = 0


class FactStore:
    """Facts in a SQLite file (default: ``engine.default_url()``) or PostgreSQL, written by a writer process.

    ``submit`` takes the router's ``Record`` effects; ``record_*`` take the other
    facts (``now`` defaults to wall-clock seconds). All return True when the
    item was buffered. ``reader`` answers queries directly; ``cache``, when
    ``cache_keys`` > 0 (or assigned a ``ChainFactsCache`` over ``reader``), is
    the routing-path read-through cache: its entries follow this store's own
    replica and lineage facts as soon as they are buffered (before their
    database write, which may still fail).
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        settings: WriterSettings = WriterSettings(),
        connect_timeout_s: float = 2.0,
        cache_keys: int = 0,
        cache_ttl_s: float = 1.0,
    ) -> None:
        self.url = url or default_url()
        self.engine = make_engine(self.url, connect_timeout_s=connect_timeout_s)
        self.reader = FactReader(self.engine)
        self.cache = ChainFactsCache(self.reader, max_keys=cache_keys, ttl_s=cache_ttl_s) if cache_keys > 0 else None
        self._bound = settings.buffer_size
        self._lock = threading.Lock()
        self._progress = threading.Condition(self._lock)
        self._outbox: list[bytes] = []
        self._counts = {f.name: 0 for f in fields(FactStoreStats)}
        self._accepted = 0
        self._processed = 0
        self._closing = False
        self._overflow_logged = 0
        self._overflow_notes = 0
        config = WriterConfig(
            self.url,
            connect_timeout_s,
            settings.batch_size,
            settings.max_retries,
            settings.backoff_s,
            settings.backoff_max_s,
        )
        self._link = WriterLink(config, self._take, self._on_report, self._on_lost, settings.linger_s)

    def submit(self, item: Record | Fact) -> bool:
        """Buffer one item for writing; False (and counted) if it was dropped instead."""
        room = self._accepted - self._processed < self._bound  # read without the lock: encode only what may fit
        data = encode_item(item) if room and not self._closing else None
        with self._lock:
            if self._closing:
                self._counts["closed_drops"] += 1
                return False
            if data is None or self._accepted - self._processed >= self._bound:
                self._counts["overflow"] += 1
                return False
            self._outbox.append(data)
            self._accepted += 1
            self._counts["submitted"] += 1
        if self.cache is not None and isinstance(item, Fact) and item.kind in CACHED_FACTS:
            try:
                self.cache.apply(fact_writes(item))
            except (UnknownKind, MalformedRecord):
                pass  # the writer rejects it, counts it and says why
        return True

    def record_model(
        self, fingerprint: bytes, name: str, architecture: str, source: str, now: float | None = None
    ) -> bool:
        params = {"fingerprint": fingerprint, "name": name, "architecture": architecture, "source": source}
        return self.submit(Fact("model", {**params, "now": time.time() if now is None else now}))

    def record_worker_start(self, worker_id: str, epoch: int, now: float | None = None) -> bool:
        started = time.time() if now is None else now
        return self.submit(Fact("worker", {"worker_id": worker_id, "epoch": epoch, "started": started, "ended": None}))

    def record_worker_end(self, worker_id: str, epoch: int, now: float | None = None) -> bool:
        ended = time.time() if now is None else now
        return self.submit(Fact("worker", {"worker_id": worker_id, "epoch": epoch, "started": None, "ended": ended}))

    def record_lineage(self, keys: Iterable[tuple[bytes, bytes | None, bytes, int]]) -> bool:
        """``keys``: ``(key, parent, model fingerprint, position)`` per chunk, one buffered item in all."""
        return self.submit(Fact("lineage", {"entries": list(keys)}))

    def record_replicas_stored(
        self, key: bytes, tier: str, location: str, bytes: int, now: float | None = None
    ) -> bool:
        params = {"key": key, "tier": tier, "location": location, "bytes": bytes}
        return self.submit(Fact("replica_stored", {**params, "now": time.time() if now is None else now}))

    def record_replica_removed(
        self, key: bytes, tier: str, location: str, reason: str, now: float | None = None
    ) -> bool:
        params = {"key": key, "tier": tier, "location": location, "reason": reason}
        return self.submit(Fact("replica_removed", {**params, "now": time.time() if now is None else now}))

    def record_replica_changes(
        self,
        tier: str,
        location: str,
        stored: Sequence[bytes],
        removed: Sequence[bytes],
        reason: str,
        bytes: int = 0,
        now: float | None = None,
    ) -> bool:
        """Replicas of many keys at one ``(tier, location)`` stored, then others removed (with ``reason``):
        one buffered item in all, written as one replica fact per key."""
        params = {
            "tier": tier,
            "location": location,
            "stored": stored,
            "removed": removed,
            "reason": reason,
            "bytes": bytes,
            "now": time.time() if now is None else now,
        }
        return self.submit(Fact("replica_changes", params))

    @property
    def writer_pid(self) -> int | None:
        """The process id of the writer now running (None between a writer's death and its replacement)."""
        return self._link.pid

    def stats(self) -> FactStoreStats:
        with self._lock:
            return FactStoreStats(**{**self._counts, "pending": self._accepted - self._processed})

    def flush(self, timeout: float) -> bool:
        """Wait until every item accepted so far is written, rejected or dropped; False on timeout."""
        with self._lock:
            target = self._accepted
        self._link.wake()
        with self._lock:
            return self._progress.wait_for(lambda: self._processed >= target, timeout)

    def close(self, timeout: float = 5.0) -> bool:
        """Stop accepting, let the writer drain the buffer (giving up at the first failure), dispose of the engine.

        True when the writer finished within ``timeout``.
        """
        with self._lock:
            already = self._closing
            self._closing = True
        finished = True if already else self._link.close(timeout)
        self._note_overflow(final=True)
        self.engine.dispose()
        return finished

    def __enter__(self) -> FactStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _take(self) -> list[bytes]:
        with self._lock:
            items, self._outbox = self._outbox, []
        self._note_overflow()
        return items

    def _on_report(self, report: list[Any]) -> None:
        if report[0] == "l":
            log.log(report[1], "%s", report[2])
            return
        with self._lock:
            for name, delta in report[2].items():
                self._counts[name] += delta
            self._processed += report[1]
            self._progress.notify_all()

    def _on_lost(self, n: int, reason: str) -> None:
        log.error("%s; %d buffered items dropped", reason, n)
        with self._lock:
            self._counts["dropped"] += n
            self._processed += n
            self._progress.notify_all()

    def _note_overflow(self, final: bool = False) -> None:
        """Log the overflow count when it grew: the first five times, every thousandth, and at close."""
        overflow = self._counts["overflow"]
        if overflow <= self._overflow_logged:
            return
        self._overflow_logged = overflow
        self._overflow_notes += 1
        if final or self._overflow_notes <= 5 or self._overflow_notes % 1000 == 0:
            log.warning(
                "fact buffer full (%d items): %d items dropped so far (overflow #%d)",
                self._bound,
                overflow,
                self._overflow_notes,
            )
