"""The router's records into a ``FactStore`` (and its ``ReplicaMap``).

``record_sink(store)`` returns the callable an interpreter hands every Record
to. Kinds ``decision``, ``offer_outcome`` and ``outcome`` go to
``FactStore.submit``; kind ``replica`` (a durable tier's residency change, data
``{worker_id, tier, stored, removed}``) becomes one ``replica_changes`` item
(one replica fact per key, the location being the worker for ssd and the
shared ``object`` tier for object), and updates the router's ``ReplicaMap`` at once.
Like ``submit``, it never blocks and never raises for the database's sake.
"""

from __future__ import annotations

from collections.abc import Callable

from kvrelay.core.router.events import Record
from kvrelay.facts.replica_map import ReplicaMap
from kvrelay.facts.store import FactStore


def record_sink(store: FactStore, replica_map: ReplicaMap | None = None) -> Callable[[Record], None]:
    submit = store.submit

    def sink(record: Record) -> None:
        if record.kind != "replica":
            submit(record)
            return
        data = record.data
        tier = data["tier"]
        location = "object" if tier == "object" else data["worker_id"]
        if replica_map is not None:
            replica_map.apply(tier, location, data["stored"], data["removed"])
        store.record_replica_changes(tier, location, data["stored"], data["removed"], "removed", now=record.now)

    return sink
