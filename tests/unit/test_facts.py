"""The fact store on a real SQLite file and a real PostgreSQL server: writes, reads, failures."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from kvrelay.core.router.events import Record
from kvrelay.facts import schema
from kvrelay.facts.cache import ChainFactsCache
from kvrelay.facts.engine import make_engine
from kvrelay.facts.queries import (
    IN_LIST_KEYS,
    FactReader,
    LineageEntry,
    Replica,
    event_replicas,
)
from kvrelay.facts.store import FactStore, WriterSettings
from kvrelay.testing.databases import (
    ENABLE_PG,
    closed_port_pg_url,
    pg_base_url,
    postgres_schema_url,
    sqlite_file_url,
)
from tests.support.log_signal import LogSignal

FP = b"model-fingerprint"


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def candidate(worker: str, ttft: float, route: list[list[Any]] | None = None, cached: int = 0) -> dict[str, Any]:
    return {
        "worker_id": worker,
        "route": route or [],
        "cached_tokens": cached,
        "predicted_ttft_s": ttft,
        "terms": {"queue_s": 0.0, "restore_s": {}, "prefill_s": ttft - 0.01, "decode_s": 0.01},
    }


def decision(rid: str, attempt: int, chosen: dict[str, Any] | None, now: float = 1.0) -> Record:
    candidates = [chosen] if chosen else []
    data = {"policy": "kvrelay", "model": "m", "chosen": chosen, "candidates": candidates, "excluded": {}}
    return Record("decision", rid, attempt, now, data)


def offer_outcome(rid: str, attempt: int, worker: str, outcome: str, reason: str | None = None) -> Record:
    return Record("offer_outcome", rid, attempt, 2.0, {"worker_id": worker, "outcome": outcome, "reason": reason})


def outcome(rid: str, attempt: int = 1, ttft: float | None = 0.05, **extra: Any) -> Record:
    data = {
        "finish_reason": "stop",
        "ttft_s": ttft,
        "inter_token_s": [0.03, 0.01, 0.02, 0.04],
        "cached_tokens": {"gpu": 64, "ssd": 128},
        "recomputed_tokens": 5,
        "generated_tokens": 5,
        "bytes_by_tier": {"ssd": 4096},
        "attempts": attempt,
        "error": None,
        **extra,
    }
    return Record("outcome", rid, attempt, 3.0, data)


@pytest.fixture
def store(fact_db_url: str) -> Iterator[FactStore]:  # noqa: F811
    with FactStore(fact_db_url) as s:
        yield s


def rows(store: FactStore, table: sa.Table, *order: sa.ColumnElement[Any]) -> list[sa.Row[Any]]:
    with store.engine.connect() as conn:
        return list(conn.execute(sa.select(table).order_by(*order)))


def test_lineage_and_live_replicas_come_back_in_one_chain_read(store: FactStore) -> None:
    store.record_model(FP, "tiny", "llama", "file:/models/tiny", now=1.0)
    store.record_lineage([(key(1), None, FP, 1), (key(2), key(1), FP, 2), (key(3), key(2), FP, 3)])
    store.record_replicas_stored(key(1), "object", "bucket/kv", 1000, now=1.0)
    store.record_replicas_stored(key(1), "ssd", "w1", 1000, now=1.0)
    store.record_replicas_stored(key(1), "ssd", "w1", 1000, now=1.5)
    store.record_replicas_stored(key(2), "ssd", "w1", 1000, now=1.0)
    store.record_replica_removed(key(2), "ssd", "w1", "evicted", now=2.0)
    store.record_replicas_stored(key(3), "ssd", "w2", 7, now=2.0)
    store.record_replica_removed(key(3), "ssd", "w2", "evicted", now=2.5)
    store.record_replicas_stored(key(3), "ssd", "w2", 9, now=3.0)
    assert store.flush(10)

    facts = store.reader.chain_facts([key(1), key(2), key(3), key(4)])
    assert facts.catalog == {
        key(1): LineageEntry(key(1), None, FP, 1),
        key(2): LineageEntry(key(2), key(1), FP, 2),
        key(3): LineageEntry(key(3), key(2), FP, 3),
    }
    assert facts.replicas == {
        key(1): [Replica(key(1), "ssd", "w1", 1000, 1.0), Replica(key(1), "object", "bucket/kv", 1000, 1.0)],
        key(3): [Replica(key(3), "ssd", "w2", 9, 3.0)],
    }
    assert store.reader.replicas_for_chain([key(1), key(2), key(3)]) == facts.replicas
    assert event_replicas([key(3), key(1)], facts.replicas) == (
        (key(3), "ssd", "w2"),
        (key(1), "ssd", "w1"),
        (key(1), "object", "bucket/kv"),
    )
    assert store.reader.catalog_for_chain([key(2), key(4)]) == {key(2): facts.catalog[key(2)]}
    history = rows(store, schema.replicas, schema.replicas.c.id)
    assert [(r.key, r.tier, r.removed, r.reason) for r in history if r.removed is not None] == [
        (key(2), "ssd", 2.0, "evicted"),
        (key(3), "ssd", 2.5, "evicted"),
    ]
    models = [(m.name, m.architecture, m.source) for m in rows(store, schema.models)]
    assert models == [("tiny", "llama", "file:/models/tiny")]
    assert store.stats().written == 10 and store.stats().rejected == 0


def test_a_chain_longer_than_one_in_list_is_read_in_full(store: FactStore) -> None:
    keys = [key(i) for i in range(IN_LIST_KEYS * 2 + 7)]
    store.record_lineage([(k, None, FP, i + 1) for i, k in enumerate(keys)])
    for k in keys[::3]:
        store.record_replicas_stored(k, "ssd", "w1", 1, now=1.0)
    assert store.flush(30)
    facts = store.reader.chain_facts(keys)
    assert set(facts.catalog) == set(keys)
    assert set(facts.replicas) == set(keys[::3])


def test_worker_start_and_end_merge_into_one_row(store: FactStore) -> None:
    store.record_worker_start("w1", 1, now=10.0)
    store.record_worker_end("w1", 1, now=20.0)
    store.record_worker_start("w1", 2, now=21.0)
    assert store.flush(10)
    store.record_worker_end("w1", 2, now=30.0)
    store.record_worker_end("w2", 5, now=31.0)
    assert store.flush(10)
    got = [(r.worker_id, r.epoch, r.started, r.ended) for r in rows(store, schema.workers, "worker_id", "epoch")]
    assert got == [("w1", 1, 10.0, 20.0), ("w1", 2, 21.0, 30.0), ("w2", 5, None, 31.0)]


@pytest.mark.parametrize("flush_each", [False, True], ids=["one-batch", "flush-each"])
def test_offer_outcomes_land_on_the_decision_they_answer(store: FactStore, flush_each: bool) -> None:
    w1_gpu = candidate("w1", 0.05, [["gpu", 2]], 128)
    w1_ssd = candidate("w1", 0.07, [["ssd", 2]], 128)
    sequence = [
        decision("r", 1, w1_gpu),
        offer_outcome("r", 1, "w1", "declined", "stale_route"),
        decision("r", 1, w1_ssd, now=2.0),
        offer_outcome("r", 1, "w1", "accepted"),
        offer_outcome("r", 1, "w1", "worker_lost", "connection closed"),
        decision("r", 2, None, now=4.0),
    ]
    for record in sequence:
        assert store.submit(record)
        if flush_each:
            assert store.flush(10)
    assert store.flush(10)
    got = [
        (d.attempt, d.chosen_worker, d.predicted_ttft_s, d.outcome, d.outcome_reason)
        for d in store.reader.request_history("r").decisions
    ]
    assert got == [
        (1, "w1", 0.05, "declined", "stale_route"),
        (1, "w1", 0.07, "worker_lost", "connection closed"),
        (2, None, None, "unroutable", None),
    ]


def test_long_free_text_is_clipped_not_rejected(store: FactStore) -> None:
    store.submit(decision("r", 1, candidate("w1", 0.05)))
    store.submit(offer_outcome("r", 1, "w1", "declined", "x" * 1000))
    store.submit(outcome("r", error="e" * 5000))
    assert store.flush(10)
    history = store.reader.request_history("r")
    reason = history.decisions[0].outcome_reason
    assert len(reason) == 256 and reason.endswith("x\u2026")
    assert len(history.outcome.error) == 2048 and store.stats().rejected == 0


def test_measured_outcome_is_summarised_and_the_last_one_wins(store: FactStore) -> None:
    store.submit(outcome("r", 1, ttft=0.5))
    store.submit(outcome("r", 2, ttft=0.25, finish_reason="length", error="x"))
    store.submit(outcome("q", 1, ttft=None, inter_token_s=[]))
    assert store.flush(10)
    r = store.reader.request_history("r").outcome
    assert (r.attempt, r.ttft_s, r.finish_reason, r.error) == (2, 0.25, "length", "x")
    itl = (r.itl_count, r.itl_mean_s, r.itl_p50_s, r.itl_p99_s, r.itl_max_s)
    assert itl == (4, pytest.approx(0.025), 0.02, 0.04, 0.04)
    assert (r.cached_tokens, r.bytes_by_tier, r.recomputed_tokens) == ({"gpu": 64, "ssd": 128}, {"ssd": 4096}, 5)
    q = store.reader.request_history("q").outcome
    assert (q.ttft_s, q.itl_count, q.itl_mean_s) == (None, 0, None)
    assert store.reader.request_history("nobody") is None


def test_an_outcome_before_any_offer_is_kept_with_attempt_0(store: FactStore) -> None:
    """A client that leaves while its request is routed or queued ends it before attempt 1; its outcome
    is stored with 0 attempts. Offers and decisions still need attempt 1 or more."""
    store.submit(outcome("early", 0, ttft=None, finish_reason="cancelled", inter_token_s=[]))
    store.submit(decision("bad", 0, None))
    assert store.flush(10)
    early = store.reader.request_history("early").outcome
    assert (early.attempt, early.finish_reason, early.ttft_s) == (0, "cancelled", None)
    assert (store.stats().written, store.stats().rejected) == (1, 1)


def test_the_routers_own_candidate_structs_are_accepted(store: FactStore) -> None:
    from kvrelay.core.planning.predicted_ttft import Candidate, Terms
    from kvrelay.protocol.messages import RouteSegment

    chosen = Candidate(
        "w1", 3, (RouteSegment("gpu", 2), RouteSegment("ssd", 1)), 192, 0.05, Terms(0.01, {"ssd": 0.002}, 0.028, 0.01)
    )
    data = {"policy": "kvrelay", "model": "m", "chosen": chosen, "candidates": [chosen], "excluded": {"w9": "epoch"}}
    assert store.submit(Record("decision", "r", 1, 1.0, data))
    assert store.flush(10)
    (row,) = store.reader.request_history("r").decisions
    assert row.chosen["route"] == [["gpu", 2, ""], ["ssd", 1, ""]]
    assert row.terms["restore_s"] == {"ssd": 0.002} and row.excluded == {"w9": "epoch"}


class LazyCandidate:
    """Stands in for a router object that materializes its candidate on first use."""

    def __init__(self, candidate: dict[str, Any]) -> None:
        self._candidate, self.materialized = candidate, False

    @property
    def best(self) -> dict[str, Any]:
        self.materialized = True
        return self._candidate


def test_lazy_candidates_are_materialized_for_the_record(store: FactStore) -> None:
    lazy = LazyCandidate(candidate("w2", 0.08))
    data = {
        "policy": "kvrelay",
        "model": "m",
        "chosen": candidate("w1", 0.05),
        "candidates": (LazyCandidate(candidate("w1", 0.05)), lazy),
        "excluded": {},
    }
    assert store.submit(Record("decision", "r", 1, 1.0, data))
    assert store.flush(10)
    (row,) = store.reader.request_history("r").decisions
    assert [c["worker_id"] for c in row.candidates] == ["w1", "w2"] and lazy.materialized


BAD_RECORDS = [
    Record("decision", "r", 1, 1.0, {"policy": "p", "model": "m", "chosen": None, "candidates": [], "excluded": []}),
    Record(
        "decision",
        "r",
        1,
        1.0,
        {"policy": "p", "model": "m", "chosen": candidate("w", float("nan")), "candidates": [], "excluded": {}},
    ),
    Record("offer_outcome", "r", 1, 1.0, {"worker_id": "w", "outcome": "maybe"}),
    Record("outcome", "r", 1, 1.0, {"finish_reason": "stop"}),
    Record("outcome", "r", 0, 1.0, {}),
    Record("decision", "r", 1, 1.0, "not a dict"),  # type: ignore[arg-type]
    ("decision", "r", 1),  # type: ignore[list-item]
]


def test_bad_records_are_rejected_with_the_field_named_and_the_writer_goes_on(
    store: FactStore, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvrelay.facts.store")
    store.record_replicas_stored(b"short", "ssd", "w1", 1)
    store.record_replicas_stored(key(1), "floppy", "w1", 1)
    for bad in BAD_RECORDS:
        assert store.submit(bad)
    store.submit(Record("heartbeat", "r", 1, 1.0, {}))
    store.submit(outcome("good"))
    assert store.flush(10)
    stats = store.stats()
    assert (stats.rejected, stats.unknown_kinds, stats.written, stats.pending) == (len(BAD_RECORDS) + 2, 1, 1, 0)
    assert store.reader.request_history("good") is not None
    messages = [r.getMessage() for r in caplog.records]
    assert "replica_stored fact: Expected `bytes` of length >= 16 - at `$.key`" in messages[0]
    assert "replica_stored fact: Invalid enum value 'floppy' - at `$.tier`" in messages[1]
    assert "decision record ('r', attempt 1): Expected `object`, got `array` - at `$.excluded`" in messages[2]
    assert "at `$.chosen.predicted_ttft_s`" in messages[3]
    assert "Invalid enum value 'maybe' - at `$.outcome`" in messages[4]
    assert sum("fact store rejected" in m for m in messages) == 5, "rejections past the fifth are counted, not logged"
    assert any("record kind 'heartbeat' is not stored" in m for m in messages)


def test_a_row_the_database_refuses_is_rejected_alone(
    fact_db_url: str,
    caplog: pytest.LogCaptureFixture,  # noqa: F811
) -> None:
    if fact_db_url.startswith("sqlite"):
        pytest.skip("SQLite stores NUL characters in text; PostgreSQL refuses them, which this test needs")
    caplog.set_level(logging.WARNING, logger="kvrelay.facts.store")
    with FactStore(fact_db_url) as store:
        for rid in ["good-1", "bad\x00id", "good-2"]:
            store.submit(outcome(rid))
        assert store.flush(10)
        stats = store.stats()
        assert (stats.written, stats.rejected, stats.dropped) == (2, 1, 0)
        assert store.reader.request_history("good-2") is not None
    assert "writing row by row" in caplog.text and "rejected one outcome row" in caplog.text


def _hanging_server() -> socket.socket:
    """A listening socket that never accepts: connections hang in the backlog, like a stuck database."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    return server


@pytest.mark.parametrize("down", ["pg-closed-port", "pg-hanging", "sqlite-bad-path"])
def test_a_down_database_never_blocks_submit_and_overflow_is_counted(
    down: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvrelay.facts.store")
    hanging = _hanging_server() if down == "pg-hanging" else None
    if hanging is not None:
        url = f"postgresql+psycopg://postgres@127.0.0.1:{hanging.getsockname()[1]}/kvrelay_down"
    elif down == "pg-closed-port":
        url = closed_port_pg_url()
    else:
        (tmp_path / "a-file").write_text("not a directory")
        url = sqlite_file_url(tmp_path / "a-file")
    settings = WriterSettings(buffer_size=50, batch_size=10, max_retries=2, backoff_s=0.3)
    store = FactStore(url, settings=settings, connect_timeout_s=1.0)
    try:
        latencies, accepted = [], 0
        for i in range(500):
            start = time.perf_counter()
            accepted += store.submit(outcome(f"r{i}"))
            latencies.append(time.perf_counter() - start)
        latencies.sort()
        assert latencies[len(latencies) // 2] < 1e-3, f"median submit {latencies[250] * 1e6:.0f} us"
        assert latencies[-1] < 0.5, f"slowest submit {latencies[-1] * 1e3:.1f} ms (the connect timeout is 1 s)"
        assert store.stats().overflow == 500 - accepted >= 500 - 50 - 10
    finally:
        assert store.close(timeout=10)
        if hanging is not None:
            hanging.close()
    stats = store.stats()
    assert stats.failed_attempts >= 1 and stats.written == 0
    assert stats.dropped == accepted and stats.pending == 0
    assert f"fact buffer full (50 items): {stats.overflow} items dropped so far" in caplog.text


def test_a_locked_sqlite_file_is_retried_until_it_frees(tmp_path: Path) -> None:
    url = sqlite_file_url(tmp_path)
    settings = WriterSettings(max_retries=50, backoff_s=0.02, backoff_max_s=0.1)
    with FactStore(url, settings=settings, connect_timeout_s=0.05) as store:
        store.submit(outcome("first"))
        assert store.flush(10)
        signal = LogSignal("retrying")
        logging.getLogger("kvrelay.facts.store").addHandler(signal)
        locker = make_engine(url).raw_connection()
        try:
            locker.execute("BEGIN EXCLUSIVE")
            store.submit(outcome("second"))
            assert signal.seen.wait(10), "the writer never hit the lock"
            assert not store.flush(0.05)
        finally:
            locker.rollback()
            locker.close()
            logging.getLogger("kvrelay.facts.store").removeHandler(signal)
        assert store.flush(10)
        assert store.reader.request_history("second") is not None
        assert store.stats().failed_attempts >= 1 and store.stats().dropped == 0


@pytest.mark.postgres
def test_connections_killed_by_the_server_are_replaced_and_nothing_is_lost() -> None:
    base = pg_base_url()
    if base is None:
        pytest.skip(ENABLE_PG)
    app = f"kvrelay_t_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(base)
    with postgres_schema_url(base) as schema_url:
        url = sa.make_url(schema_url).update_query_dict({"application_name": app}).render_as_string(hide_password=False)
        with FactStore(url, settings=WriterSettings(backoff_s=0.01)) as store:
            store.submit(outcome("before"))
            assert store.flush(10)
            with admin.begin() as conn:
                kill = "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = :a"
                killed = conn.execute(sa.text(kill), {"a": app}).scalar()
            assert killed >= 1
            alive = "SELECT count(*) FROM pg_stat_activity WHERE application_name = :a"
            deadline = time.monotonic() + 10
            with admin.connect() as conn:
                while conn.execute(sa.text(alive), {"a": app}).scalar():
                    conn.rollback()  # pg_stat_activity is a snapshot per transaction: look again in a new one
                    assert time.monotonic() < deadline, "terminated backends did not exit"
            store.submit(outcome("after"))
            assert store.flush(10)
            stats = store.stats()
            assert (stats.written, stats.dropped) == (2, 0) and stats.failed_attempts >= 1
            assert store.reader.request_history("after") is not None
    admin.dispose()


def test_sqlite_runs_in_wal_mode(tmp_path: Path) -> None:
    engine = make_engine(sqlite_file_url(tmp_path))
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    engine.dispose()


def test_an_unsupported_url_names_the_fix() -> None:
    with pytest.raises(ValueError, match="is not SQLite or PostgreSQL; use sqlite:///PATH or postgresql"):
        make_engine("mysql+pymysql://u@h/db")


def test_submit_after_close_is_dropped_and_counted(tmp_path: Path) -> None:
    store = FactStore(sqlite_file_url(tmp_path))
    assert store.close()
    assert not store.submit(outcome("late"))
    assert store.stats().closed_drops == 1


def test_the_cache_reads_through_once_and_follows_own_writes(store: FactStore) -> None:
    store.record_lineage([(key(1), None, FP, 1)])
    store.record_replicas_stored(key(1), "ssd", "w1", 10, now=1.0)
    assert store.flush(10)
    clock = [0.0]
    cache = ChainFactsCache(store.reader, max_keys=3, ttl_s=5.0, clock=lambda: clock[0])
    store.cache = cache
    first = cache.chain_facts([key(1), key(2)])
    assert first.replicas == {key(1): [Replica(key(1), "ssd", "w1", 10, 1.0)]} and key(2) not in first.catalog
    assert cache.chain_facts([key(1), key(2)]) == first
    assert (cache.stats().hits, cache.stats().misses) == (2, 2)

    store.record_replicas_stored(key(2), "object", "b/p", 20, now=2.0)
    store.record_replica_removed(key(1), "ssd", "w1", "evicted", now=2.0)
    assert store.flush(10)
    follows = cache.chain_facts([key(1), key(2)])
    assert follows.replicas == {key(2): [Replica(key(2), "object", "b/p", 20, 2.0)]}
    assert cache.stats().misses == 2, "own writes must be applied without a database read"

    cache.chain_facts([key(3), key(4)])
    assert cache.stats().keys == 3
    with FactStore(store.url) as other_writer:
        other_writer.record_replicas_stored(key(3), "ssd", "w3", 30, now=3.0)
        assert other_writer.flush(10)
    assert key(3) not in cache.chain_facts([key(3)]).replicas, "within ttl_s the cached answer stands"
    clock[0] = 10.0
    assert cache.chain_facts([key(3)]).replicas == {key(3): [Replica(key(3), "ssd", "w3", 30, 3.0)]}


def test_the_cache_answers_empty_when_the_database_is_down() -> None:
    engine = make_engine(closed_port_pg_url(), connect_timeout_s=1.0)
    clock = [0.0]
    cache = ChainFactsCache(FactReader(engine), max_keys=10, ttl_s=1.0, retry_after_s=5.0, clock=lambda: clock[0])
    assert cache.chain_facts([key(1)]).replicas == {}
    assert cache.chain_facts([key(1), key(2)]).catalog == {}
    assert (cache.stats().read_errors, cache.stats().skipped_reads, cache.stats().keys) == (1, 2, 0)
    clock[0] = 6.0
    cache.chain_facts([key(1)])
    assert cache.stats().read_errors == 2
    engine.dispose()


def test_the_benchmark_runs_at_smoke_size(tmp_path: Path) -> None:
    out = tmp_path / "facts.json"
    env = {k: v for k, v in os.environ.items() if k != "KVRELAY_TEST_PG_URL"}
    bench = Path(__file__).resolve().parents[2] / "bench" / "facts.py"
    done = subprocess.run(
        [sys.executable, str(bench), "--quick", "--json", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert {f["name"] for f in figures} >= {"sqlite_chain_facts_L32_us", "sqlite_decision_writes_per_s"}
    assert all(set(f) == {"name", "value", "unit", "baseline", "baseline_value"} for f in figures)
