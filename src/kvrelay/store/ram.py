"""The ``ram`` tier: chunks in host memory, bounded in bytes, least recently used evicted first.

The tier keeps a reference to the buffer given to ``put`` (no copy): the caller
must not write into it afterwards. ``get`` returns a view over that same buffer.
With ``verify_payload=True`` (the default) every ``get`` checks the payload
digest; with False the digest is checked once when the chunk is admitted
(a chunk that fails is counted, reported and not stored) and reads check the
header only, so restores from ram run at memory-copy speed.
"""

from __future__ import annotations

from typing import Any

from kvrelay.store.chunk_format import ChunkView, decode_whole_header
from kvrelay.store.tier import (
    ChunkTier,
    CorruptionListener,
    LruIndex,
    ResidencyListener,
)


class RamTier(ChunkTier):
    """Host-memory chunk tier holding at most ``capacity_bytes`` of stored chunks."""

    name = "ram"
    durable = False

    def __init__(
        self,
        capacity_bytes: int,
        on_residency: ResidencyListener | None = None,
        on_corrupt: CorruptionListener | None = None,
        verify_payload: bool = True,
    ) -> None:
        super().__init__(on_residency, on_corrupt, verify_payload)
        self._index = LruIndex(capacity_bytes)
        self._buffers: dict[bytes, Any] = {}

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._index.used_bytes

    def put(self, blob: Any) -> bool:
        header = decode_whole_header(blob)
        size = header.total_len
        if not self.verify_payload and self.contains(header.key):
            return False
        if not self.verify_payload and self._verify(blob, header.key, None, verify_payload=True) is None:
            return False
        with self._lock:
            if header.key in self._index:
                self._index.touch(header.key)
                return False
            if not self._index.fits(size):
                return False
            victims = self._index.admit(header.key, size)
            for victim in victims:
                del self._buffers[victim]
            self._buffers[header.key] = blob
            self._counters.add(bytes_written=size, chunks_written=1, evictions=len(victims))
            self._emit((), victims, "evicted")
            self._emit((header.key,), (), "stored")
            return True

    def get(self, key: bytes, fingerprint: bytes | None = None) -> ChunkView | None:
        with self._lock:
            blob = self._buffers.get(key)
            if blob is None:
                self._counters.add(misses=1)
                return None
            self._index.touch(key)
        return self._served(blob, key, fingerprint)

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    def keys(self) -> list[bytes]:
        with self._lock:
            return self._index.keys()

    def _delete(self, key: bytes) -> bool:
        if self._index.pop(key) is None:
            return False
        del self._buffers[key]
        return True
