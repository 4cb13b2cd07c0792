"""The router's in-memory residency index: which worker holds which chunk key on which tier.

Residency events (``protocol.messages.Residency``) are its input, plus the
router's own prediction of what a routed request will leave on its worker's
device (``PENDING``, kept by ``planning.pending``). Each key maps to one packed
integer: nibble 0 holds the shared object tier (``OBJECT``), nibble ``slot + 1``
holds the local tiers (``GPU | RAM | SSD``) and the ``PENDING`` mark of the
worker in that slot. Memory is bounded by ``max_keys``: an LRU over keys by the time of
their last store event; the oldest key is forgotten first (the router then
merely under-estimates a cache hit; the worker stays authoritative).

Equal packed values are one shared int object (``_shared``, bounded): a
chain's keys mostly carry the same few values, so a lookup touches one hot
object per run instead of one cold object per key, and ``runs`` compares them
by identity.

Contract:
- after ``store(w, tier, keys)``, ``lookup`` reports ``tier`` for ``w`` on each key;
- after ``remove`` it does not; after ``drop_worker(w)`` nothing of ``w`` remains;
- ``keys_of(w, tier)`` and ``holdings()`` list what ``lookup`` would report;
- ``len(index) <= max_keys`` always.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import groupby, repeat, takewhile

GPU, RAM, SSD, OBJECT = 1, 2, 4, 8
PENDING = 8
"""In a worker's nibble: a routed request is computing or restoring the key there (not resident yet)."""
TIER_BITS: dict[str, int] = {"gpu": GPU, "ram": RAM, "ssd": SSD, "object": OBJECT, "pending": PENDING}
LOCAL_MASK = GPU | RAM | SSD
HELD_MASK = LOCAL_MASK | PENDING
"""Everything a worker's nibble can hold."""
PEER_SERVABLE = RAM | SSD
"""A peer serves its ram and ssd chunks, not its device pages."""
SHARED_VALUES = 1 << 16
"""Bound of the pool of shared packed values; a full pool starts over (values already stored stay shared)."""


class ResidencyIndex:
    def __init__(self, max_keys: int = 2_000_000) -> None:
        if max_keys <= 0:
            raise ValueError(f"max_keys must be positive, got {max_keys}")
        self.max_keys = max_keys
        self._entries: dict[bytes, int] = {}
        self._slots: dict[str, int] = {}
        self._worker_keys: dict[str, set[bytes]] = {}
        self._shared: dict[int, int] = {}
        self.workers_by_slot: list[str] = []
        self.all_peer_bits = 0
        """Peer-servable bits of every known worker."""
        self.forgotten = 0
        """Keys dropped by the LRU bound."""

    def __len__(self) -> int:
        return len(self._entries)

    def slot(self, worker_id: str) -> int:
        """The stable slot of a worker (assigned on first sight)."""
        s = self._slots.get(worker_id)
        if s is None:
            s = self._slots[worker_id] = len(self._slots)
            self._worker_keys[worker_id] = set()
            self.workers_by_slot.append(worker_id)
            self.all_peer_bits |= PEER_SERVABLE << (4 * (s + 1))
        return s

    def store(self, worker_id: str, tier: str, keys: Iterable[bytes]) -> None:
        bit = TIER_BITS.get(tier)
        if bit is None:
            return
        shared = tier == "object"
        shift = 0 if shared else 4 * (self.slot(worker_id) + 1)
        mine = None if shared else self._worker_keys[worker_id]
        entries = self._entries
        share = self._share()
        add = bit << shift
        for key in keys:
            value = entries.pop(key, 0) | add
            entries[key] = share(value, value)
            if mine is not None:
                mine.add(key)
        while len(entries) > self.max_keys:
            self._forget(next(iter(entries)))

    def remove(self, worker_id: str, tier: str, keys: Iterable[bytes]) -> None:
        bit = TIER_BITS.get(tier)
        if bit is None:
            return
        shared = tier == "object"
        shift = 0 if shared else 4 * (self.slot(worker_id) + 1)
        entries = self._entries
        share = self._share()
        for key in keys:
            value = entries.get(key)
            if value is None:
                continue
            value &= ~(bit << shift)
            if value:
                entries[key] = share(value, value)
            else:
                del entries[key]
            if not shared and not (value >> shift) & HELD_MASK:
                self._worker_keys[worker_id].discard(key)

    def drop_worker(self, worker_id: str) -> int:
        """Forget every local residency of ``worker_id`` (an epoch ended); returns how many keys."""
        keys = self._worker_keys.get(worker_id)
        if not keys:
            return 0
        clear = ~(0xF << (4 * (self._slots[worker_id] + 1)))
        entries = self._entries
        share = self._share()
        for key in keys:
            value = entries.get(key)
            if value is None:
                continue
            value &= clear
            if value:
                entries[key] = share(value, value)
            else:
                del entries[key]
        n = len(keys)
        self._worker_keys[worker_id] = set()
        return n

    def _share(self) -> Callable[[int, int], int]:
        """``setdefault`` of the shared value pool (emptied first when it reached its bound)."""
        if len(self._shared) >= SHARED_VALUES:
            self._shared.clear()
        return self._shared.setdefault

    def _forget(self, key: bytes) -> None:
        value = self._entries.pop(key)
        self.forgotten += 1
        for wid, s in self._slots.items():
            if (value >> (4 * (s + 1))) & HELD_MASK:
                self._worker_keys[wid].discard(key)

    def runs(self, chain: Sequence[bytes]) -> list[tuple[int, int]]:
        """``lookup(chain)`` run-length encoded: ``(packed value, consecutive keys with it)``, in chain order."""
        values = takewhile(bool, map(self._entries.get, chain, repeat(0)))
        return [(value, len(list(group))) for value, group in groupby(values)]

    def value(self, key: bytes) -> int:
        """The packed value of one key (0: nobody holds it)."""
        return self._entries.get(key, 0)

    def lookup(self, chain: Sequence[bytes]) -> list[int]:
        """Packed values of the chain's leading keys, stopping at the first key nobody holds."""
        return list(takewhile(bool, map(self._entries.get, chain)))  # type: ignore[arg-type]

    def tiers_of(self, value: int, worker_id: str) -> int:
        """The local tier bits ``worker_id`` holds in a packed value."""
        s = self._slots.get(worker_id)
        return 0 if s is None else (value >> (4 * (s + 1))) & LOCAL_MASK

    def holders(self, value: int) -> list[tuple[str, int]]:
        """``(worker_id, local tier bits)`` for every worker holding the key."""
        return [(wid, bits) for wid, s in self._slots.items() if (bits := (value >> (4 * (s + 1))) & LOCAL_MASK)]

    def keys_of(self, worker_id: str, tier: str) -> list[bytes]:
        """The keys the index lists for ``worker_id`` on local ``tier``, sorted (the same whatever the hash seed)."""
        bit = TIER_BITS.get(tier, 0) & LOCAL_MASK
        s = self._slots.get(worker_id)
        if not bit or s is None:
            return []
        shift, entries = 4 * (s + 1), self._entries
        return sorted(key for key in self._worker_keys[worker_id] if (entries.get(key, 0) >> shift) & bit)

    def holdings(self) -> tuple[dict[str, dict[str, list[bytes]]], list[bytes]]:
        """Everything the index holds: per worker, its keys by local tier name; and the object tier's keys."""
        names = [(name, bit) for name, bit in TIER_BITS.items() if bit & LOCAL_MASK]
        local: dict[str, dict[str, list[bytes]]] = {wid: {name: [] for name, _ in names} for wid in self._slots}
        shared: list[bytes] = []
        for key, value in self._entries.items():
            if value & OBJECT:
                shared.append(key)
            for wid, s in self._slots.items():
                bits = (value >> (4 * (s + 1))) & LOCAL_MASK
                for name, bit in names:
                    if bits & bit:
                        local[wid][name].append(key)
        return local, shared

    @property
    def slots(self) -> dict[str, int]:
        """Worker id -> slot (read-only use: the nibble of slot ``s`` starts at bit ``4 * s + 4``)."""
        return self._slots

    def shift_of(self, worker_id: str) -> int | None:
        """Bit offset of a worker's nibble, or None for a worker never seen."""
        s = self._slots.get(worker_id)
        return None if s is None else 4 * (s + 1)

    def first_peer(self, value: int, peer_bits: int) -> str:
        """The lowest-slot worker whose peer-servable bits are set in ``value & peer_bits``."""
        bits = value & peer_bits
        low = (bits & -bits).bit_length() - 1
        return self.workers_by_slot[low // 4 - 1]
