"""What every chunk tier shares: the tier contract, residency and corruption reports, counters.

A tier maps 16-byte chunk keys to chunks in the stored form of ``chunk_format``.
Contract of ``ChunkTier`` (all methods are thread-safe):

- ``get(key, fingerprint)`` returns a verified ``ChunkView`` or ``None``. A chunk
  that fails verification is never returned: it is logged, counted as
  ``corrupt``, reported to ``on_corrupt``, removed from the tier (reported to
  ``on_residency`` with reason ``corrupt``) and the call is a miss.
- ``put(blob)`` stores a chunk whose header names its key; it returns True when
  the tier now holds a chunk it did not hold before (False: already held, or
  larger than the tier). Chunks are immutable: a key already held is left as it
  is. A blob whose header is malformed raises ``ChunkCorrupt``; payload digests
  are the reader's to check (``put`` trusts blobs made by ``encode_chunk`` or
  returned verified by another tier), except in a ram tier that checks headers only.
- Every change of what a tier holds is reported to ``on_residency`` as one
  ``ResidencyEvent`` (tier, durable, stored keys, removed keys, reason), in the
  order the changes happened. Listeners run under the tier's lock: they must be
  quick and must not call back into the tier.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import Any, Literal

from kvrelay.store.chunk_format import ChunkCorrupt, ChunkView, decode_chunk

log = logging.getLogger(__name__)

TierName = Literal["ram", "ssd", "peer", "object"]
ResidencyReason = Literal["stored", "recovered", "evicted", "removed", "corrupt"]


@dataclass(frozen=True)
class ResidencyEvent:
    """Keys a tier began (``stored``) or stopped (``removed``) holding; ``durable`` tiers are replica facts."""

    tier: TierName
    durable: bool
    stored: tuple[bytes, ...]
    removed: tuple[bytes, ...]
    reason: ResidencyReason


@dataclass(frozen=True)
class CorruptChunk:
    """A chunk that failed verification in ``tier`` (or ``source``, for a peer or bucket)."""

    tier: TierName
    key: bytes
    reason: str
    source: str = ""


ResidencyListener = Callable[[ResidencyEvent], None]
CorruptionListener = Callable[[CorruptChunk], None]


@dataclass(frozen=True)
class TierCounters:
    """A snapshot of one tier's counters since it was created."""

    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    chunks_written: int = 0
    evictions: int = 0
    removals: int = 0
    errors: int = 0


COUNTER_NAMES: tuple[str, ...] = tuple(f.name for f in fields(TierCounters))


class Counters:
    """Thread-safe mutable counters behind ``TierCounters`` snapshots."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(COUNTER_NAMES, 0)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._values[name] += delta

    def snapshot(self) -> TierCounters:
        with self._lock:
            return TierCounters(**self._values)


class ChunkSource(ABC):
    """Something chunks can be read from: every tier, and a remote peer."""

    name: TierName

    def __init__(self, on_corrupt: CorruptionListener | None = None, verify_payload: bool = True) -> None:
        self._counters = Counters()
        self._on_corrupt = on_corrupt
        self.verify_payload = verify_payload

    def counters(self) -> TierCounters:
        return self._counters.snapshot()

    @abstractmethod
    def get(self, key: bytes, fingerprint: bytes | None = None) -> ChunkView | None:
        """The verified chunk ``key``, or None on a miss (a corrupt chunk is a miss)."""

    @abstractmethod
    def contains(self, key: bytes) -> bool:
        """Whether the tier holds ``key`` (unverified: a later ``get`` may still miss)."""

    def _verify(
        self, buffer: Any, key: bytes, fingerprint: bytes | None, source: str = "", verify_payload: bool | None = None
    ) -> ChunkView | None:
        """Decode ``buffer`` as ``key``; on failure log, count and report it and return None.

        The payload digest is checked when ``verify_payload`` says so (default: the tier's setting).
        """
        check_payload = self.verify_payload if verify_payload is None else verify_payload
        try:
            return decode_chunk(buffer, key, fingerprint, verify_payload=check_payload)
        except ChunkCorrupt as err:
            log.warning(
                "corrupt chunk %s in tier %s%s: %s", key.hex(), self.name, f" ({source})" if source else "", err.reason
            )
            self._counters.add(corrupt=1, misses=1)
            if self._on_corrupt is not None:
                self._on_corrupt(CorruptChunk(self.name, key, err.reason, source))
            return None


class ChunkTier(ChunkSource):
    """A tier that stores chunks: ``put``, ``get``, ``contains``, ``remove``, ``keys``."""

    durable: bool = False

    def __init__(
        self,
        on_residency: ResidencyListener | None = None,
        on_corrupt: CorruptionListener | None = None,
        verify_payload: bool = True,
    ) -> None:
        super().__init__(on_corrupt, verify_payload)
        self._lock = threading.RLock()
        self._on_residency = on_residency

    @abstractmethod
    def put(self, blob: Any) -> bool:
        """Store the chunk ``blob`` (stored form); True when it was not held before."""

    def remove(self, key: bytes) -> bool:
        """Drop ``key``; True when it was held (and then reported with reason ``removed``)."""
        with self._lock:
            if not self._delete(key):
                return False
            self._counters.add(removals=1)
            self._emit((), (key,), "removed")
            return True

    @abstractmethod
    def _delete(self, key: bytes) -> bool:
        """Drop ``key`` from storage and index without reporting it; True when it was held."""

    def _served(self, buffer: Any, key: bytes, fingerprint: bytes | None) -> ChunkView | None:
        """Verify a buffer read from this tier and count the hit; a corrupt one is removed and reported,
        and None returned."""
        view = self._verify(buffer, key, fingerprint)
        if view is None:
            with self._lock:
                if self._delete(key):
                    self._emit((), (key,), "corrupt")
        else:
            self._counters.add(hits=1, bytes_read=view.nbytes)
        return view

    @abstractmethod
    def keys(self) -> list[bytes]:
        """The keys the tier holds now."""

    def _emit(self, stored: Iterable[bytes], removed: Iterable[bytes], reason: ResidencyReason) -> None:
        """Report a residency change; call with ``self._lock`` held so events keep their order."""
        stored_t, removed_t = tuple(stored), tuple(removed)
        if self._on_residency is not None and (stored_t or removed_t):
            self._on_residency(ResidencyEvent(self.name, self.durable, stored_t, removed_t, reason))


class LruIndex:
    """Keys with their sizes in least-recently-used order, bounded by ``capacity_bytes`` (None: unbounded).

    Not thread-safe: a tier calls it with its lock held.
    """

    def __init__(self, capacity_bytes: int | None) -> None:
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._sizes: OrderedDict[bytes, int] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def keys(self) -> list[bytes]:
        return list(self._sizes)

    def touch(self, key: bytes) -> None:
        """Mark ``key`` most recently used."""
        self._sizes.move_to_end(key)

    def fits(self, size: int) -> bool:
        return self.capacity_bytes is None or size <= self.capacity_bytes

    def admit(self, key: bytes, size: int) -> list[bytes]:
        """Add ``key`` (not yet held, ``fits(size)``) as most recent; evict and return LRU keys until it fits."""
        victims: list[bytes] = []
        while self.capacity_bytes is not None and self.used_bytes + size > self.capacity_bytes:
            victim, victim_size = self._sizes.popitem(last=False)
            self.used_bytes -= victim_size
            victims.append(victim)
        self._sizes[key] = size
        self.used_bytes += size
        return victims

    def pop(self, key: bytes) -> int | None:
        """Forget ``key``; its size, or None when it was not held."""
        size = self._sizes.pop(key, None)
        if size is not None:
            self.used_bytes -= size
        return size
