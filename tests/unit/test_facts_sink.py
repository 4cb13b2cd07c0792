"""Router records reach the fact store: durable residency becomes replica facts the next request can use."""

from __future__ import annotations

from pathlib import Path

from kvrelay.controller.events import Record
from kvrelay.facts.sink import record_sink
from kvrelay.facts.store import FactStore


def test_replica_records_become_queryable_replica_facts(tmp_path: Path) -> None:
    keys = (b"a" * 16, b"b" * 16)
    with FactStore(f"sqlite:///{tmp_path / 'facts.sqlite3'}") as store:
        sink = record_sink(store)
        sink(Record("replica", "", 0, 1.0, {"worker_id": "w0", "tier": "ssd", "stored": keys, "removed": ()}))
        sink(Record("replica", "", 0, 2.0, {"worker_id": "w1", "tier": "object", "stored": keys[:1], "removed": ()}))
        sink(Record("replica", "", 0, 3.0, {"worker_id": "w0", "tier": "ssd", "stored": (), "removed": keys[1:]}))
        assert store.flush(10)
        replicas = store.reader.replicas_for_chain(list(keys))
    assert sorted((r.tier, r.location) for r in replicas[keys[0]]) == [("object", "object"), ("ssd", "w0")]
    assert replicas.get(keys[1], []) == []
