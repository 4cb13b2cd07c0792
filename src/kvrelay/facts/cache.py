"""A read-through cache of chain facts for the routing path.

Contract:
- ``chain_facts(keys)`` answers each key from an entry fetched at most
  ``ttl_s`` ago (negative answers too: a key the store does not know), and
  fetches every other key in one ``FactReader.chain_facts`` call.
- At most ``max_keys`` keys are held; the least recently used go first.
- ``apply(writes)`` updates the entries of keys already cached with replica
  stores and removals and lineage (the ``FactStore`` writer calls it as it
  takes each batch); keys not cached are read from the database later.
- A database error never propagates: the keys it could not read are answered
  as unknown (and not cached), the error is counted in ``read_errors``, and
  no read is tried again for ``retry_after_s`` (misses during that window are
  counted in ``skipped_reads``), so a down database costs routing at most one
  failed read per window.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import sqlalchemy as sa

from kvrelay.facts.queries import (
    ChainFacts,
    FactReader,
    LineageEntry,
    Replica,
    replica_order,
)
from kvrelay.facts.records import Write

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Entry:
    fetched: float
    lineage: LineageEntry | None
    replicas: tuple[Replica, ...]


@dataclass(frozen=True, slots=True)
class CacheStats:
    hits: int
    misses: int
    read_errors: int
    skipped_reads: int
    keys: int


class ChainFactsCache:
    """Chain facts by key, read through from a ``FactReader`` (see module docstring)."""

    def __init__(
        self,
        reader: FactReader,
        *,
        max_keys: int,
        ttl_s: float,
        retry_after_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_keys <= 0:
            raise ValueError(f"max_keys must be positive, got {max_keys}")
        self._reader = reader
        self._max_keys = max_keys
        self._ttl_s = ttl_s
        self._retry_after_s = retry_after_s
        self._clock = clock
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self._failed_at: float | None = None
        self._hits = self._misses = self._read_errors = self._skipped = 0

    def chain_facts(self, keys: Sequence[bytes]) -> ChainFacts:
        now = self._clock()
        oldest = now - self._ttl_s
        facts = ChainFacts()
        missing: list[bytes] = []
        with self._lock:
            entries = self._entries
            for key in keys:
                entry = entries.get(key)
                if entry is None or entry.fetched < oldest:
                    missing.append(key)
                    continue
                entries.move_to_end(key)
                _add(facts, key, entry)
            self._hits += len(keys) - len(missing)
            self._misses += len(missing)
        if missing:
            for key, entry in self._fetch(list(dict.fromkeys(missing)), now).items():
                _add(facts, key, entry)
        return facts

    def replicas_for_chain(self, keys: Sequence[bytes]) -> dict[bytes, list[Replica]]:
        return self.chain_facts(keys).replicas

    def catalog_for_chain(self, keys: Sequence[bytes]) -> dict[bytes, LineageEntry]:
        return self.chain_facts(keys).catalog

    def _fetch(self, missing: list[bytes], now: float) -> dict[bytes, _Entry]:
        with self._lock:
            if self._failed_at is not None and now - self._failed_at < self._retry_after_s:
                self._skipped += len(missing)
                return {}
        try:
            read = self._reader.chain_facts(missing)
        except (sa.exc.SQLAlchemyError, OSError) as exc:
            with self._lock:
                self._failed_at = now
                self._read_errors += 1
            log.warning("fact store read failed; routing without stored facts for %.1fs: %s", self._retry_after_s, exc)
            return {}
        fetched = {key: _Entry(now, read.catalog.get(key), tuple(read.replicas.get(key, ()))) for key in missing}
        with self._lock:
            self._failed_at = None
            self._entries.update(fetched)
            for key in fetched:
                self._entries.move_to_end(key)
            while len(self._entries) > self._max_keys:
                self._entries.popitem(last=False)
        return fetched

    def apply(self, writes: Iterable[Write]) -> None:
        """Update cached entries with replica and lineage writes; other writes and uncached keys are ignored."""
        with self._lock:
            for write in writes:
                p = write.params
                if write.op == "replica_stored":
                    self._update(
                        p["key"],
                        lambda e: _with_replica(
                            e, Replica(p["key"], p["tier"], p["location"], p["bytes"], p["created"])
                        ),
                    )
                elif write.op == "replica_removed":
                    self._update(
                        p["p_key"],
                        lambda e: replace(
                            e,
                            replicas=tuple(
                                r for r in e.replicas if (r.tier, r.location) != (p["p_tier"], p["p_location"])
                            ),
                        ),
                    )
                elif write.op == "lineage":
                    self._update(
                        p["key"],
                        lambda e: replace(
                            e, lineage=LineageEntry(p["key"], p["parent"], p["model_fingerprint"], p["position"])
                        ),
                    )

    def _update(self, key: bytes, change: Callable[[_Entry], _Entry]) -> None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries[key] = change(entry)

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(self._hits, self._misses, self._read_errors, self._skipped, len(self._entries))


def _add(facts: ChainFacts, key: bytes, entry: _Entry) -> None:
    if entry.lineage is not None:
        facts.catalog[key] = entry.lineage
    if entry.replicas:
        facts.replicas[key] = list(entry.replicas)


def _with_replica(entry: _Entry, replica: Replica) -> _Entry:
    if any((r.tier, r.location) == (replica.tier, replica.location) for r in entry.replicas):
        return entry
    return replace(entry, replicas=tuple(sorted((*entry.replicas, replica), key=replica_order)))
