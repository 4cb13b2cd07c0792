"""Simulated KV caches of one worker, per tier, emitting residency changes.

- ``gpu``: a page pool (``pages_total`` pages of ``page_tokens``). Cached chunks
  occupy ``chunk_tokens / page_tokens`` pages each, in LRU order; reservations of
  admitted requests occupy pages too. Pinned chunks (the prefix of running work)
  are never evicted. A chunk evicted from gpu is demoted to ``ram``.
- ``ram`` and ``ssd``: LRU sets of chunk keys with a capacity in chunks; a chunk
  evicted from ram is demoted to ssd; one evicted from ssd is dropped.
- ``object``: one unbounded set shared by every worker (``SharedObjectTier``).

Every change is buffered as the net stored/removed state of a key per tier and
drained as residency batches by the simulator.
"""

from __future__ import annotations

from collections import OrderedDict

TierChanges = dict[str, dict[bytes, bool]]
"""tier -> key -> True (stored) / False (removed), the net change since the last drain."""


class SharedObjectTier:
    """The unbounded shared object tier: a set of keys every worker can read."""

    def __init__(self) -> None:
        self.keys: set[bytes] = set()


class LruTier:
    """Chunk keys in least-recently-used order, at most ``capacity`` of them."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def insert(self, key: bytes) -> list[bytes]:
        """Store or refresh ``key``; return the keys evicted to make room."""
        if key in self.entries:
            self.entries.move_to_end(key)
            return []
        self.entries[key] = None
        evicted: list[bytes] = []
        while len(self.entries) > self.capacity:
            evicted.append(self.entries.popitem(last=False)[0])
        return evicted


class GpuPool:
    """Device pages: cached chunks (LRU, pin counts) plus reserved pages."""

    def __init__(self, pages_total: int, chunk_pages: int) -> None:
        self.pages_total = pages_total
        self.chunk_pages = chunk_pages
        self.reserved = 0
        self.cache: OrderedDict[bytes, int] = OrderedDict()
        self.pinned_chunks = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self.cache

    @property
    def free_pages(self) -> int:
        return self.pages_total - self.reserved - len(self.cache) * self.chunk_pages

    @property
    def evictable_pages(self) -> int:
        return (len(self.cache) - self.pinned_chunks) * self.chunk_pages

    def pin(self, key: bytes) -> None:
        pins = self.cache[key]
        if pins == 0:
            self.pinned_chunks += 1
        self.cache[key] = pins + 1
        self.cache.move_to_end(key)

    def unpin(self, key: bytes) -> None:
        pins = self.cache[key] - 1
        self.cache[key] = pins
        if pins == 0:
            self.pinned_chunks -= 1

    def evict_for(self, pages: int) -> list[bytes]:
        """Evict unpinned chunks, least recently used first, until ``pages`` are free; return them.

        The caller checked ``pages <= free_pages + evictable_pages``.
        """
        short = pages - self.free_pages
        evicted: list[bytes] = []
        if short <= 0:
            return evicted
        for key, pins in self.cache.items():
            if pins == 0:
                evicted.append(key)
                short -= self.chunk_pages
                if short <= 0:
                    break
        for key in evicted:
            del self.cache[key]
        return evicted

    def insert_pinned(self, key: bytes) -> None:
        """Add a chunk whose pages come out of the caller's reservation, pinned once."""
        self.reserved -= self.chunk_pages
        self.cache[key] = 0
        self.pin(key)


class WorkerCaches:
    """The gpu, ram and ssd tiers of one worker and its view of the shared object tier."""

    def __init__(
        self,
        gpu_pages: int,
        chunk_pages: int,
        ram_chunks: int,
        ssd_chunks: int,
        shared: SharedObjectTier,
        object_write_through: bool,
    ) -> None:
        self.gpu = GpuPool(gpu_pages, chunk_pages)
        self.ram = LruTier(ram_chunks)
        self.ssd = LruTier(ssd_chunks)
        self.shared = shared
        self.object_write_through = object_write_through
        self.changes: TierChanges = {}

    def _note(self, tier: str, key: bytes, stored: bool) -> None:
        self.changes.setdefault(tier, {})[key] = stored

    def drain_changes(self) -> TierChanges:
        changes, self.changes = self.changes, {}
        return changes

    def lose_volatile(self) -> None:
        """A crash: gpu and ram are gone (no residency is reported: the epoch ends them all)."""
        self.gpu = GpuPool(self.gpu.pages_total, self.gpu.chunk_pages)
        self.ram = LruTier(self.ram.capacity)
        self.changes = {}

    def announce_durable(self) -> None:
        """Buffer the ssd contents as stored (after a restart, for the new epoch)."""
        if self.ssd.entries:
            self.changes.setdefault("ssd", {}).update(dict.fromkeys(self.ssd.entries, True))

    def reserve(self, pages: int) -> None:
        """Evict for and reserve ``pages`` (admission checked they fit)."""
        self._demote_from_gpu(self.gpu.evict_for(pages))
        self.gpu.reserved += pages

    def release(self, pages: int) -> None:
        self.gpu.reserved -= pages

    def _demote_from_gpu(self, keys: list[bytes]) -> None:
        for key in keys:
            self._note("gpu", key, False)
            if key not in self.ram:
                self._note("ram", key, True)
                for dropped in self.ram.insert(key):
                    self._note("ram", dropped, False)
                    self._demote_to_ssd(dropped)
            else:
                self.ram.insert(key)

    def _demote_to_ssd(self, key: bytes) -> None:
        if key in self.ssd:
            self.ssd.insert(key)
            return
        self._note("ssd", key, True)
        for dropped in self.ssd.insert(key):
            self._note("ssd", dropped, False)

    def add_to_gpu(self, key: bytes, computed: bool) -> bool:
        """Pin a chunk just filled (restored, or computed when ``computed``).

        True when its pages came out of the caller's reservation; False when the
        chunk was already resident (another request filled it) and is only pinned.
        """
        if key in self.gpu:
            self.gpu.pin(key)
            return False
        self.gpu.insert_pinned(key)
        self._note("gpu", key, True)
        if computed and self.object_write_through and key not in self.shared.keys:
            self.shared.keys.add(key)
            self._note("object", key, True)
        return True

    def restore_sources(self, key: bytes) -> tuple[str, ...]:
        """Local tiers (fastest first) holding ``key``, the shared object tier included."""
        found: list[str] = []
        if key in self.gpu:
            found.append("gpu")
        if key in self.ram:
            found.append("ram")
        if key in self.ssd:
            found.append("ssd")
        if key in self.shared.keys:
            found.append("object")
        return tuple(found)
