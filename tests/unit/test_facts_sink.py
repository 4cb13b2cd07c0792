"""Router records reach the fact store: durable residency becomes replica facts the next request can use."""

from __future__ import annotations

from pathlib import Path

from kvrelay.core.router.events import Record
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


def test_the_replica_map_of_a_fresh_database_is_empty(fact_db_url: str) -> None:
    """SQLite reports a missing table as an OperationalError, PostgreSQL as a ProgrammingError: both mean empty."""
    import sqlalchemy as sa

    from kvrelay.facts.replica_map import ReplicaMap

    engine = sa.create_engine(fact_db_url)
    try:
        assert len(ReplicaMap.load(engine)) == 0
    finally:
        engine.dispose()


def test_the_replica_map_of_a_sqlite_file_in_a_directory_not_made_yet_is_empty(tmp_path: Path) -> None:
    """A router on a fresh data directory starts: the writer makes the directory, the file and the schema later."""
    import sqlalchemy as sa

    from kvrelay.facts.replica_map import ReplicaMap

    missing = tmp_path / "not-yet" / "facts.sqlite3"
    engine = sa.create_engine(f"sqlite:///{missing}")
    try:
        assert len(ReplicaMap.load(engine)) == 0
    finally:
        engine.dispose()
    assert not missing.parent.exists()


def test_the_replica_map_loads_live_replicas_and_follows_the_routers_records(tmp_path: Path) -> None:
    from kvrelay.facts.replica_map import ReplicaMap

    keys = (b"a" * 16, b"b" * 16, b"c" * 16)
    url = f"sqlite:///{tmp_path / 'facts.sqlite3'}"
    with FactStore(url) as store:
        assert len(ReplicaMap.load(store.engine)) == 0  # a fresh database
        sink = record_sink(store)
        sink(Record("replica", "", 0, 1.0, {"worker_id": "w0", "tier": "ssd", "stored": keys[:2], "removed": ()}))
        sink(Record("replica", "", 0, 2.0, {"worker_id": "w0", "tier": "ssd", "stored": (), "removed": keys[1:2]}))
        assert store.flush(10)
    with FactStore(url) as store:  # a router restart
        replicas = ReplicaMap.load(store.engine)
        assert replicas.held_by("w0") == ((keys[0], "ssd", "w0"),)
        live = record_sink(store, replicas)
        live(Record("replica", "", 0, 3.0, {"worker_id": "w1", "tier": "object", "stored": keys[2:], "removed": ()}))
        assert replicas.held_by("w0") == ((keys[0], "ssd", "w0"),)
        assert replicas.of_tier("object") == ((keys[2], "object", "object"),)
