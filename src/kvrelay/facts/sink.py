"""The router's link to a ``FactStore``: its records in, durable replica facts of a chain out.

``record_sink(store)`` returns the callable an interpreter hands every Record
to. Kinds ``decision``, ``offer_outcome`` and ``outcome`` go to
``FactStore.submit``; kind ``replica`` (a durable tier's residency change, data
``{worker_id, tier, stored, removed}``) becomes one replica fact per key, the
location being the worker for ssd and the shared ``object`` tier for object.
Like ``submit``, it never blocks and never raises for the database's sake.
"""

from __future__ import annotations

from collections.abc import Callable

from kvrelay.controller.events import Record, Replica
from kvrelay.facts.queries import event_replicas
from kvrelay.facts.store import FactStore


def replica_lookup(store: FactStore) -> Callable[[tuple[bytes, ...]], tuple[Replica, ...]]:
    """The durable replicas of a chain for ``RequestArrived``, read through the store's cache (or directly)."""
    reader = store.cache if store.cache is not None else store.reader

    def lookup(chain: tuple[bytes, ...]) -> tuple[Replica, ...]:
        return event_replicas(chain, reader.replicas_for_chain(list(chain))) if chain else ()

    return lookup


def record_sink(store: FactStore) -> Callable[[Record], None]:
    def sink(record: Record) -> None:
        if record.kind != "replica":
            store.submit(record)
            return
        data = record.data
        location = "object" if data["tier"] == "object" else data["worker_id"]
        for key in data["stored"]:
            store.record_replicas_stored(key, data["tier"], location, 0, record.now)
        for key in data["removed"]:
            store.record_replica_removed(key, data["tier"], location, "removed", record.now)

    return sink
