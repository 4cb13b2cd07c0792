"""The worker's page pool: reference counts, a prefix index, an LRU of cached pages, durable marks
and atomic reservations (docs/design.md section 7).

Every page is in exactly one state:

- ``free``: holds nothing;
- ``cached``: unreferenced but holds a full chunk's KV that the index can hand out again (evictable);
- ``referenced``: used by at least one live sequence (reference count > 0);
- ``reserved``: held by a ``Reservation`` for a sequence that has not written it yet.

Invariant after every operation (``check``): free + cached + referenced + reserved = total, and no
page is in two states. A reservation holds N pages nobody else can take; the sequence consumes them
page by page (``take``) and returns the rest with ``release``. Eviction takes cached pages only,
durable ones (already saved to a lower tier) first, then least recently used, and never a page of a
protected route. Like vLLM's block manager (vllm/v1/core/block_pool.py), a released sequence's
pages enter the LRU tail first, so a chain is evicted from its end and its prefix stays matchable.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kvrelay.protocol.chunk_keys import DEFAULT_CHUNK_TOKENS, DEFAULT_PAGE_TOKENS

ResidencyCallback = Callable[[tuple[bytes, ...], tuple[bytes, ...]], None]
"""``(stored keys, removed keys)`` of the gpu tier."""


class PagePoolError(RuntimeError):
    """A misuse of the pool (a double release, taking more than was reserved): a bug in the caller."""


class PoolExhaustedError(RuntimeError):
    """More pages were asked for than are free or evictable."""


@dataclass(slots=True)
class Reservation:
    """Pages held for one sequence; ``take`` moves them to the sequence, ``PagePool.release`` returns the rest."""

    owner: str
    pages: list[int] = field(default_factory=list)
    released: bool = False

    @property
    def remaining(self) -> int:
        return len(self.pages)


class Eviction(NamedTuple):
    key: bytes
    pages: tuple[int, ...]
    reason: str
    """``durable`` (saved to a lower tier) or ``lru``."""


class ReservePlan(NamedTuple):
    """What ``reserve`` would do: take ``free`` free pages and evict these chunks."""

    free: int
    evictions: tuple[Eviction, ...]


class PagePool:
    def __init__(
        self,
        num_pages: int,
        page_tokens: int = DEFAULT_PAGE_TOKENS,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        on_residency: ResidencyCallback | None = None,
    ) -> None:
        if num_pages < 1:
            raise ValueError(f"a page pool needs at least one page, got {num_pages}")
        if chunk_tokens % page_tokens:
            raise ValueError(f"chunk_tokens {chunk_tokens} must be a multiple of page_tokens {page_tokens}")
        self.num_pages = num_pages
        self.page_tokens = page_tokens
        self.pages_per_chunk = chunk_tokens // page_tokens
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._refcount = [0] * num_pages
        self._reserved: set[int] = set()
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        """Keys of fully unreferenced, not yet durable chunks, least recently used first."""
        self._lru_durable: OrderedDict[bytes, None] = OrderedDict()
        """The same for durable chunks: these are evicted first."""
        self._chunks: dict[bytes, tuple[int, ...]] = {}
        self._page_key: dict[int, bytes] = {}
        self._durable: set[bytes] = set()
        self.on_residency = on_residency
        self.evictions: list[Eviction] = []
        """Every eviction so far, with its reason (the caller may drain it)."""

    # --- observation ----------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return (len(self._lru) + len(self._lru_durable)) * self.pages_per_chunk

    @property
    def num_reserved(self) -> int:
        return len(self._reserved)

    @property
    def num_referenced(self) -> int:
        return self.num_pages - len(self._free) - self.num_cached - len(self._reserved)

    @property
    def num_evictable(self) -> int:
        return self.num_cached

    def resident_keys(self) -> list[bytes]:
        """Keys of every chunk the prefix index holds (the gpu tier's residency)."""
        return list(self._chunks)

    def resident_prefix(self, chain: Sequence[bytes]) -> list[tuple[int, ...]]:
        """Pages of the longest resident prefix of ``chain`` (one tuple per chunk)."""
        out: list[tuple[int, ...]] = []
        for key in chain:
            pages = self._chunks.get(key)
            if pages is None:
                break
            out.append(pages)
        return out

    def is_durable(self, key: bytes) -> bool:
        return key in self._durable

    # --- reservations -----------------------------------------------------------

    def plan_reserve(self, n: int, protected: Iterable[int] = ()) -> ReservePlan | None:
        """How ``n`` pages could be found without touching ``protected`` pages, or None."""
        if n <= len(self._free):
            return ReservePlan(n, ())
        need = n - len(self._free)
        if need > self.num_cached:
            return None
        guard = set(protected)
        evictions: list[Eviction] = []
        for reason, keys in (("durable", self._lru_durable), ("lru", self._lru)):
            for key in keys:
                if need <= 0:
                    break
                pages = self._chunks[key]
                if guard and not guard.isdisjoint(pages):
                    continue
                evictions.append(Eviction(key, pages, reason))
                need -= len(pages)
        if need > 0:
            return None
        return ReservePlan(len(self._free), tuple(evictions))

    def reserve(self, owner: str, n: int, protected: Iterable[int] = ()) -> Reservation | None:
        """Atomically hold ``n`` pages for ``owner`` (evicting per ``plan_reserve``), or None changing nothing."""
        plan = self.plan_reserve(n, protected)
        if plan is None:
            return None
        removed = []
        for ev in plan.evictions:
            self._evict(ev)
            removed.append(ev.key)
        pages = [self._free.pop() for _ in range(n)]
        self._reserved.update(pages)
        if removed and self.on_residency is not None:
            self.on_residency((), tuple(removed))
        return Reservation(owner, pages)

    def take(self, reservation: Reservation, n: int) -> list[int]:
        """Move the first ``n`` reserved pages, in order, to the sequence (reference count 1)."""
        if reservation.released:
            raise PagePoolError(f"reservation of {reservation.owner} was already released")
        if n > len(reservation.pages):
            raise PagePoolError(f"{reservation.owner} takes {n} pages but holds {len(reservation.pages)}")
        pages = reservation.pages[:n]
        del reservation.pages[:n]
        for p in pages:
            self._reserved.discard(p)
            self._refcount[p] = 1
        return pages

    def release(self, reservation: Reservation) -> int:
        """Return the unused pages of a reservation to the free list; returns how many."""
        if reservation.released:
            raise PagePoolError(f"reservation of {reservation.owner} was already released")
        reservation.released = True
        n = len(reservation.pages)
        for p in reservation.pages:
            self._reserved.discard(p)
            self._free.append(p)
        reservation.pages = []
        return n

    def release_leading(self, reservation: Reservation, n: int) -> list[int]:
        """Return the first ``n`` reserved pages to the free list (the sequence shares resident pages instead)."""
        if reservation.released:
            raise PagePoolError(f"reservation of {reservation.owner} was already released")
        if n > len(reservation.pages):
            raise PagePoolError(f"{reservation.owner} returns {n} pages but holds {len(reservation.pages)}")
        pages = reservation.pages[:n]
        del reservation.pages[:n]
        for p in pages:
            self._reserved.discard(p)
            self._free.append(p)
        return pages

    def allocate(self, n: int, owner: str = "") -> list[int]:
        """Reserve and take ``n`` pages at once (for a caller without admission); ``PoolExhaustedError`` if short."""
        reservation = self.reserve(owner, n)
        if reservation is None:
            raise PoolExhaustedError(
                f"asked for {n} pages but only {self.num_free} of {self.num_pages} are free and "
                f"{self.num_evictable} evictable; free finished sequences' pages or start with more pages"
            )
        pages = self.take(reservation, n)
        self.release(reservation)
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Drop the reference ``allocate`` gave (pages holding no indexed chunk become free)."""
        self.unref(pages)

    # --- sharing and caching ------------------------------------------------------

    def acquire(self, chunks: Iterable[tuple[int, ...]]) -> None:
        """Reference resident chunks for a new sequence (they leave the LRU while referenced)."""
        for pages in chunks:
            key = self._page_key[pages[0]]
            self._lru.pop(key, None)
            self._lru_durable.pop(key, None)
            for p in pages:
                self._refcount[p] += 1

    def register(self, key: bytes, pages: Sequence[int]) -> bool:
        """Index a full chunk the sequence just wrote into ``pages``; False if the key was already resident."""
        if len(pages) != self.pages_per_chunk:
            raise PagePoolError(f"a chunk spans {self.pages_per_chunk} pages, got {len(pages)}")
        if key in self._chunks:
            return False
        if any(self._refcount[p] <= 0 or p in self._page_key for p in pages):
            raise PagePoolError(f"pages {list(pages)} are not exclusively held by the registering sequence")
        self._chunks[key] = tuple(pages)
        for p in pages:
            self._page_key[p] = key
        if self.on_residency is not None:
            self.on_residency((key,), ())
        return True

    def mark_durable(self, key: bytes) -> None:
        """The chunk is saved to a lower tier: evict it before non-durable chunks."""
        if key in self._chunks and key not in self._durable:
            self._durable.add(key)
            if key in self._lru:
                del self._lru[key]
                self._lru_durable[key] = None

    def unref(self, pages: Sequence[int]) -> None:
        """Drop one reference from each page (a sequence ended); tail chunks enter the LRU first."""
        for p in pages:
            if self._refcount[p] <= 0:
                raise PagePoolError(f"page {p} is not referenced (double release?)")
        for p in reversed(pages):
            self._refcount[p] -= 1
            if self._refcount[p]:
                continue
            key = self._page_key.get(p)
            if key is None:
                self._free.append(p)
            elif all(self._refcount[q] == 0 for q in self._chunks[key]):
                (self._lru_durable if key in self._durable else self._lru)[key] = None

    def _evict(self, ev: Eviction) -> None:
        (self._lru_durable if ev.key in self._durable else self._lru).pop(ev.key)
        del self._chunks[ev.key]
        self._durable.discard(ev.key)
        for p in ev.pages:
            del self._page_key[p]
            self._free.append(p)
        self.evictions.append(ev)

    # --- invariant ------------------------------------------------------------------

    def check(self) -> None:
        """Raise ``PagePoolError`` unless every page is in exactly one state and the counts add up."""
        free = set(self._free)
        cached = {p for lru in (self._lru, self._lru_durable) for k in lru for p in self._chunks[k]}
        referenced = {p for p, c in enumerate(self._refcount) if c > 0}
        reserved = set(self._reserved)
        states = (free, cached, referenced, reserved)
        if len(free) != len(self._free):
            raise PagePoolError("a page is free twice")
        total = sum(len(s) for s in states)
        overlap = (
            (free & cached)
            | (free & referenced)
            | (free & reserved)
            | (cached & referenced)
            | (cached & reserved)
            | (referenced & reserved)
        )
        if overlap or total != self.num_pages:
            raise PagePoolError(
                f"pool invariant broken: free {len(free)} + cached {len(cached)} + referenced {len(referenced)} "
                f"+ reserved {len(reserved)} != {self.num_pages} or pages in two states: {sorted(overlap)[:8]}"
            )
        if any(c < 0 for c in self._refcount):
            raise PagePoolError("negative reference count")
