"""The router's in-memory map of live durable replicas, complete for that router.

Contract: ``ReplicaMap.load(engine)`` reads every live replica fact (ssd and
object tiers) once, at router start; from then on the router's own replica
records keep it current (``record_sink`` applies each before handing it to
the store's writer), so ``held_by(location)`` and ``of_tier(tier)`` answer
from memory with no database read. The router reads
``of_tier("object")`` when it starts and ``held_by(worker)`` when a worker's
epoch begins (``core.router.events.LoadReplicas``): the only moments this map
knows a replica the router's residency index does not. This holds while one router writes the replica
facts of its cluster, which is how ``kvrelay serve`` and ``kvrelay router``
run; several routers sharing one fact store would each see only their own
changes after start (the store's ``ChainFactsCache`` with a TTL suits that).

Replicas are kept per ``(tier, location)`` in the order they were added.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import sqlalchemy as sa

from kvrelay.core.router.events import Replica
from kvrelay.facts.engine import sqlite_path
from kvrelay.facts.schema import LIVE_REPLICA, replicas


class ReplicaMap:
    def __init__(self) -> None:
        self._by_place: dict[tuple[str, str], dict[bytes, None]] = {}
        """``(tier, location)`` -> its keys, in the order they were added."""
        self._lock = threading.Lock()

    @classmethod
    def load(cls, engine: sa.Engine) -> ReplicaMap:
        """Every live replica of the store (an empty map when the schema, or the SQLite file and its directory,
        does not exist yet)."""
        out = cls()
        path = sqlite_path(engine)
        if path is not None and not path.exists():
            return out  # a fresh data directory: the writer creates it, the file and the schema
        statement = sa.select(replicas.c.key, replicas.c.tier, replicas.c.location).where(LIVE_REPLICA)
        with engine.connect() as conn:
            if not sa.inspect(conn).has_table(replicas.name):
                return out  # a fresh database: the writer creates the schema
            for key, tier, location in conn.execute(statement):
                out.add(bytes(key), tier, location)
        return out

    def __len__(self) -> int:
        """How many live replicas."""
        return sum(len(keys) for keys in self._by_place.values())

    def add(self, key: bytes, tier: str, location: str) -> None:
        self.apply(tier, location, (key,), ())

    def remove(self, key: bytes, tier: str, location: str) -> None:
        self.apply(tier, location, (), (key,))

    def apply(self, tier: str, location: str, stored: Iterable[bytes], removed: Iterable[bytes]) -> None:
        """Replicas of ``stored`` keys at ``(tier, location)`` added, then those of ``removed`` keys dropped."""
        with self._lock:
            place = self._by_place.setdefault((tier, location), {})
            for key in stored:
                place.setdefault(key, None)
            for key in removed:
                place.pop(key, None)
            if not place:
                del self._by_place[(tier, location)]

    def held_by(self, location: str) -> tuple[Replica, ...]:
        """Every live replica at ``location`` (a worker id or a bucket), tier by tier."""
        with self._lock:
            return tuple(
                (key, tier, loc) for (tier, loc), keys in self._by_place.items() if loc == location for key in keys
            )

    def of_tier(self, tier: str) -> tuple[Replica, ...]:
        """Every live replica on ``tier``, location by location."""
        with self._lock:
            return tuple(
                (key, t, location) for (t, location), keys in self._by_place.items() if t == tier for key in keys
            )
