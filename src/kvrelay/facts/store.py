"""``FactStore``: buffered, batched writes of facts, off the routing path.

Contract:
- ``submit(record)`` and the ``record_*`` methods never block on the database
  and never raise because of it: they append to a bounded in-memory buffer and
  return at once (True), or, when the buffer is full or the store is closed,
  drop the item, count it (``overflow`` or ``closed_drops``) and return False.
- One background thread drains the buffer in batches of at most
  ``batch_size`` items. It validates each item (``records.to_writes``): an
  unknown kind is counted in ``unknown_kinds``, malformed data in ``rejected``,
  each logged with the reason; neither stops the writer. A batch is written in
  one transaction with one ``executemany`` per group of same-operation writes
  (lanes in ``records.OPS`` order, order kept within a lane).
- A batch that fails for a database reason (down, locked, read-only, schema
  missing) is retried with exponential backoff up to ``max_retries`` times,
  then dropped and counted in ``dropped`` (every attempt that failed is counted
  in ``failed_attempts``); a batch that fails for a data reason (a constraint,
  a value the database refuses) is retried row by row so only the bad rows are
  rejected. The writer thread survives every error. Log lines are throttled
  per category (the first five, then every thousandth); the counters are exact.
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
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any

import sqlalchemy as sa

from kvrelay.controller.events import Record
from kvrelay.facts.cache import ChainFactsCache
from kvrelay.facts.engine import create_schema, default_url, make_engine
from kvrelay.facts.queries import FactReader
from kvrelay.facts.records import (
    OPS,
    Fact,
    MalformedRecord,
    UnknownKind,
    Write,
    to_writes,
)
from kvrelay.facts.statements import CONFLICT_KEYS, build_statements

log = logging.getLogger(__name__)


def is_data_error(exc: BaseException) -> bool:
    """True for errors that retrying the same rows cannot fix: constraints, bad values, unbindable parameters."""
    if isinstance(exc, (sa.exc.IntegrityError, sa.exc.DataError)):
        return True
    return isinstance(exc, sa.exc.StatementError) and not isinstance(exc, sa.exc.DBAPIError)


@dataclass(frozen=True, slots=True)
class WriterSettings:
    """Bounds of the buffer and of the writer's retries."""

    buffer_size: int = 10_000
    batch_size: int = 500
    max_retries: int = 5
    backoff_s: float = 0.05
    backoff_max_s: float = 2.0


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
    pending: int = 0


class _Throttle:
    """Logs the first few messages of each category, then every 1000th, with its count."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}

    def log(self, level: int, category: str, message: str, *args: Any) -> None:
        n = self._counts[category] = self._counts.get(category, 0) + 1
        if n <= 5 or n % 1000 == 0:
            log.log(level, message + " (%s #%d)", *args, category, n)


def plan_groups(writes: list[tuple[int, Write]]) -> list[tuple[str, list[tuple[int, Write]]]]:
    """Group a batch's writes for ``executemany``: lanes in ``OPS`` order, order kept within a lane.

    Replica stores and removals share one lane, so a store, removal and re-store
    of one replica keep their order. A new group starts whenever the operation
    changes or an upsert's conflict key repeats within the group.
    """
    lane = {op: i for i, op in enumerate(OPS)}
    lane["replica_removed"] = lane["replica_stored"]
    ordered = sorted(writes, key=lambda iw: lane[iw[1].op])
    groups: list[tuple[str, list[tuple[int, Write]]]] = []
    seen: set[tuple[Any, ...]] = set()
    for item in ordered:
        op = item[1].op
        conflict = CONFLICT_KEYS.get(op)
        key = tuple(item[1].params[k] for k in conflict) if conflict else None
        if not groups or groups[-1][0] != op or (key is not None and key in seen):
            groups.append((op, []))
            seen = set()
        groups[-1][1].append(item)
        if key is not None:
            seen.add(key)
    return groups


class FactStore:
    """Facts in a SQLite file (default: ``engine.default_url()``) or PostgreSQL, written by one thread.

    ``submit`` takes the router's ``Record`` effects; ``record_*`` take the other
    facts (``now`` defaults to wall-clock seconds). All return True when the
    item was buffered. ``reader`` answers queries directly; ``cache``, when
    ``cache_keys`` > 0 (or assigned a ``ChainFactsCache`` over ``reader``), is
    the routing-path read-through cache: its entries follow this store's own
    replica and lineage facts as soon as the writer takes them (before their
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
        self._settings = settings
        self._statements = build_statements(self.engine.dialect.name)
        self._lock = threading.Lock()
        self._has_items = threading.Condition(self._lock)
        self._progress = threading.Condition(self._lock)
        self._buffer: deque[Record | Fact] = deque()
        self._counts = {f.name: 0 for f in fields(FactStoreStats)}
        self._accepted = 0
        self._processed = 0
        self._closing = False
        self._give_up = False
        self._stop = threading.Event()
        self._schema_ready = False
        self._throttle = _Throttle()
        self._overflow_logged = 0
        self._thread = threading.Thread(target=self._run, name="kvrelay-facts-writer", daemon=True)
        self._thread.start()

    def submit(self, item: Record | Fact) -> bool:
        """Buffer one item for writing; False (and counted) if it was dropped instead."""
        with self._lock:
            if self._closing:
                self._counts["closed_drops"] += 1
                return False
            if len(self._buffer) >= self._settings.buffer_size:
                self._counts["overflow"] += 1
                return False
            self._buffer.append(item)
            self._accepted += 1
            self._counts["submitted"] += 1
            self._has_items.notify()
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

    def stats(self) -> FactStoreStats:
        with self._lock:
            return FactStoreStats(**{**self._counts, "pending": self._accepted - self._processed})

    def flush(self, timeout: float) -> bool:
        """Wait until every item accepted so far is written, rejected or dropped; False on timeout."""
        with self._lock:
            target = self._accepted
            return self._progress.wait_for(lambda: self._processed >= target, timeout)

    def close(self, timeout: float = 5.0) -> bool:
        """Stop accepting, drain the buffer (giving up at the first failure), dispose of the engine.

        True when the writer finished within ``timeout``.
        """
        with self._lock:
            self._closing = True
            self._has_items.notify_all()
        self._stop.set()
        self._thread.join(timeout)
        self.engine.dispose()
        return not self._thread.is_alive()

    def __enter__(self) -> FactStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def _run(self) -> None:
        while True:
            with self._lock:
                self._has_items.wait_for(lambda: bool(self._buffer) or self._closing)
                if not self._buffer:
                    return
                take = min(self._settings.batch_size, len(self._buffer))
                batch = [self._buffer.popleft() for _ in range(take)]
            try:
                self._write_batch(batch)
            except Exception:
                log.exception("fact writer: unexpected error; %d items dropped", len(batch))
                self._count("dropped", len(batch))
            with self._lock:
                self._processed += len(batch)
                self._progress.notify_all()
                overflow = self._counts["overflow"]
            if overflow > self._overflow_logged:
                self._overflow_logged = overflow
                self._throttle.log(
                    logging.WARNING, "overflow", "fact buffer full (%d items): %d items dropped so far",
                    self._settings.buffer_size, overflow,
                )

    def _validated(self, batch: list[Record | Fact]) -> list[tuple[int, Write]]:
        writes: list[tuple[int, Write]] = []
        for index, item in enumerate(batch):
            try:
                writes.extend((index, w) for w in to_writes(item))
            except UnknownKind as exc:
                self._count("unknown_kinds")
                self._throttle.log(logging.WARNING, "unknown_kind", "fact store ignored %s", exc)
            except MalformedRecord as exc:
                self._count("rejected")
                self._throttle.log(logging.WARNING, "malformed", "fact store rejected %s", exc)
        return writes

    def _write_batch(self, batch: list[Record | Fact]) -> None:
        writes = self._validated(batch)
        if self.cache is not None:
            self.cache.apply([w for _, w in writes])
        items = {index for index, _ in writes}
        if not items:
            return
        if self._give_up:
            self._count("dropped", len(items))
            return
        groups = plan_groups(writes)
        for attempt in range(self._settings.max_retries + 1):
            try:
                self._execute(groups)
                self._count("written", len(items))
                return
            except (sa.exc.SQLAlchemyError, OSError) as exc:
                if is_data_error(exc):
                    self._throttle.log(
                        logging.WARNING, "data_error", "fact batch hit a data error, writing row by row: %s", exc
                    )
                    self._write_rows(writes)
                    return
                self._schema_ready = False
                self._count("failed_attempts")
                if self._closing or attempt == self._settings.max_retries:
                    self._give_up = self._closing
                    self._count("dropped", len(items))
                    where = self.engine.url.render_as_string(hide_password=True)
                    self._throttle.log(
                        logging.ERROR, "dropped", "fact store %s unavailable; dropped %d items after %d attempts: %s",
                        where, len(items), attempt + 1, exc,
                    )
                    return
                delay = min(self._settings.backoff_max_s, self._settings.backoff_s * 2**attempt)
                self._throttle.log(
                    logging.WARNING, "unavailable", "fact store write failed, retrying in %.2fs: %s", delay, exc
                )
                self._stop.wait(delay)

    def _execute(self, groups: list[tuple[str, list[tuple[int, Write]]]]) -> None:
        if not self._schema_ready:
            create_schema(self.engine)
            self._schema_ready = True
        with self.engine.begin() as conn:
            for op, group in groups:
                conn.execute(self._statements[op], [w.params for _, w in group])

    def _write_rows(self, writes: list[tuple[int, Write]]) -> None:
        failed: set[int] = set()
        for index, write in writes:
            if index in failed:
                continue
            try:
                with self.engine.begin() as conn:
                    conn.execute(self._statements[write.op], [write.params])
            except (sa.exc.SQLAlchemyError, OSError) as exc:
                failed.add(index)
                self._throttle.log(logging.WARNING, "row_rejected", "fact store rejected one %s row: %s", write.op, exc)
        self._count("rejected", len(failed))
        self._count("written", len({index for index, _ in writes} - failed))
