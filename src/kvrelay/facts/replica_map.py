"""The router's in-memory map of live durable replicas, complete for that router.

Contract: ``ReplicaMap.load(engine)`` reads every live replica fact (ssd and
object tiers) once, at router start; from then on the router's own replica
records keep it current (``record_sink`` applies each before handing it to
the store's writer), so ``lookup(chain)`` answers from memory with no database
read on the routing path. This holds while one router writes the replica
facts of its cluster, which is how ``kvrelay serve`` and ``kvrelay router``
run; several routers sharing one fact store would each see only their own
changes after start (the store's ``ChainFactsCache`` with a TTL suits that).

Each key maps to the tuple of its ``Replica``s, in the order they were added,
replaced whole on every change: ``lookup`` reads without the lock and never
sees a half-made change.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from itertools import chain as concat

import sqlalchemy as sa

from kvrelay.controller.events import Replica
from kvrelay.facts.schema import LIVE_REPLICA, replicas


class ReplicaMap:
    def __init__(self) -> None:
        self._by_key: dict[bytes, tuple[Replica, ...]] = {}
        self._lock = threading.Lock()

    @classmethod
    def load(cls, engine: sa.Engine) -> ReplicaMap:
        """Every live replica of the store (an empty map when the schema does not exist yet)."""
        out = cls()
        statement = sa.select(replicas.c.key, replicas.c.tier, replicas.c.location).where(LIVE_REPLICA)
        try:
            with engine.connect() as conn:
                for key, tier, location in conn.execute(statement):
                    out.add(bytes(key), tier, location)
        except sa.exc.OperationalError:
            pass  # a fresh database: the writer creates the schema
        return out

    def __len__(self) -> int:
        return len(self._by_key)

    def add(self, key: bytes, tier: str, location: str) -> None:
        self.apply(tier, location, (key,), ())

    def remove(self, key: bytes, tier: str, location: str) -> None:
        self.apply(tier, location, (), (key,))

    def apply(self, tier: str, location: str, stored: Iterable[bytes], removed: Iterable[bytes]) -> None:
        """Replicas of ``stored`` keys at ``(tier, location)`` added, then those of ``removed`` keys dropped."""
        by_key = self._by_key
        with self._lock:
            for key in stored:
                replica = (key, tier, location)
                places = by_key.get(key, ())
                if replica not in places:
                    by_key[key] = (*places, replica)
            for key in removed:
                places = by_key.get(key, ())
                kept = tuple(r for r in places if r[1] != tier or r[2] != location)
                if kept:
                    by_key[key] = kept
                elif places:
                    del by_key[key]

    def lookup(self, chain: Sequence[bytes]) -> tuple[Replica, ...]:
        """``(key, tier, location)`` of every live replica of the chain's keys, in chain order."""
        if not self._by_key:
            return ()
        return tuple(concat.from_iterable(filter(None, map(self._by_key.get, chain))))
