"""A worker's stack of chunk tiers: write-through ram, then ssd, then object (each optional).

- ``put`` writes a chunk through every configured tier, fastest first (a file
  tier that cannot write, e.g. a full disk, stores nothing and the others go on;
  any other error from a tier propagates, and tiers before it keep the chunk).
- ``get`` looks the chunk up fastest first and says which tier answered.
- ``localize`` brings a chunk from a slower source into a local tier: one from a
  peer the router named into ram (ssd when there is no ram tier), one from the
  object tier into ssd, read back through ``mmap`` (ram when there is no ssd
  tier); as fetched when neither can hold it. docs/design.md section 8.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvrelay.store.chunk_format import ChunkView
from kvrelay.store.ram import RamTier
from kvrelay.store.tier import ChunkSource, ChunkTier, TierName


@dataclass(frozen=True)
class StackHit:
    """A verified chunk and the tier it was found in (``peer`` / ``object`` when localized from there)."""

    tier: TierName
    view: ChunkView


class TierStack:
    """The local tiers of one worker plus its object tier, fastest first."""

    def __init__(
        self, ram: RamTier | None = None, ssd: ChunkTier | None = None, object_tier: ChunkTier | None = None
    ) -> None:
        self.ram = ram
        self.ssd = ssd
        self.object_tier = object_tier

    @property
    def tiers(self) -> tuple[ChunkTier, ...]:
        """The configured tiers, fastest first."""
        return tuple(t for t in (self.ram, self.ssd, self.object_tier) if t is not None)

    @property
    def local_tiers(self) -> tuple[ChunkTier, ...]:
        """The tiers this worker serves to its peers (ram, ssd)."""
        return tuple(t for t in (self.ram, self.ssd) if t is not None)

    def put(self, blob: Any) -> tuple[TierName, ...]:
        """Write ``blob`` through every tier; the names of the tiers that newly stored it."""
        return tuple(tier.name for tier in self.tiers if tier.put(blob))

    def residency(self, key: bytes) -> tuple[TierName, ...]:
        """The tiers that report holding ``key`` (unverified), fastest first."""
        return tuple(tier.name for tier in self.tiers if tier.contains(key))

    def get(self, key: bytes, fingerprint: bytes | None = None) -> StackHit | None:
        """The verified chunk from the fastest tier holding it; the object tier's copy is localized."""
        for tier in (self.ram, self.ssd):
            if tier is not None and (view := tier.get(key, fingerprint)) is not None:
                return StackHit(tier.name, view)
        if self.object_tier is not None:
            return self.localize(key, fingerprint, self.object_tier)
        return None

    def fetch(self, key: bytes, fingerprint: bytes | None, remotes: Sequence[ChunkSource] = ()) -> StackHit | None:
        """``get``, then each of ``remotes`` (peers the router named) in order, localizing what is found."""
        hit = self.get(key, fingerprint)
        for remote in remotes:
            if hit is not None:
                break
            hit = self.localize(key, fingerprint, remote)
        return hit

    def localize(self, key: bytes, fingerprint: bytes | None, source: ChunkSource) -> StackHit | None:
        """Copy ``key`` from ``source`` into a local tier and return the local view: a peer's chunk into ram
        (else ssd), an object-tier chunk into ssd (else ram).

        Returns None when ``source`` misses (a corrupt copy is a miss). The hit's
        tier names ``source``; its view is the ssd file's mapping when ssd holds it.
        A peer's chunk goes to ram because it is on a restore's path and the peer
        still holds it: ram keeps the fetched buffer (no copy, no file write); an
        object-tier chunk goes to ssd, the local copy that outlives ram's eviction
        of a chunk slow to fetch again (docs/design.md section 8).
        """
        fetched = source.get(key, fingerprint)
        if fetched is None:
            return None
        order = (self.ram, self.ssd) if source.name == "peer" else (self.ssd, self.ram)
        for local in order:
            if local is None:
                continue
            local.put(fetched.buffer)
            if local is self.ram:
                # The ram tier keeps the fetched buffer itself: no second read is needed.
                if self.ram.contains(key):
                    return StackHit(source.name, fetched)
                continue
            if (view := local.get(key, fingerprint)) is not None:
                return StackHit(source.name, view)
        return StackHit(source.name, fetched)
