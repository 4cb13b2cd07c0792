"""The router's records into a ``FactStore`` (and its ``ReplicaMap``).

``record_sink(store)`` returns the callable an interpreter hands every Record
to. Kinds ``decision``, ``offer_outcome`` and ``outcome`` go to
``FactStore.submit``; kind ``replica`` (a durable tier's residency change, data
``{worker_id, tier, stored, removed}``) becomes one replica fact per key, the
location being the worker for ssd and the shared ``object`` tier for object,
and updates the router's ``ReplicaMap`` at once.
Like ``submit``, it never blocks and never raises for the database's sake.
"""

from __future__ import annotations

from collections.abc import Callable

from kvrelay.controller.events import Record
from kvrelay.facts.replica_map import ReplicaMap
from kvrelay.facts.store import FactStore


def record_sink(store: FactStore, replica_map: ReplicaMap | None = None) -> Callable[[Record], None]:
    def sink(record: Record) -> None:
        if record.kind != "replica":
            store.submit(record)
            return
        data = record.data
        location = "object" if data["tier"] == "object" else data["worker_id"]
        for key in data["stored"]:
            if replica_map is not None:
                replica_map.add(key, data["tier"], location)
            store.record_replicas_stored(key, data["tier"], location, 0, record.now)
        for key in data["removed"]:
            if replica_map is not None:
                replica_map.remove(key, data["tier"], location)
            store.record_replica_removed(key, data["tier"], location, "removed", record.now)

    return sink
