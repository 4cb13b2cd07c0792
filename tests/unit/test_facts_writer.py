"""The fact store's writer process: lazy router candidates, draining on close, surviving its own death."""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

from kvrelay.core.router.events import Record
from kvrelay.facts.replica_map import ReplicaMap
from kvrelay.facts.store import FactStore, WriterSettings
from kvrelay.facts.wire import (
    FrameBuffer,
    batch_frame,
    decode_items,
    encode_item,
    frame,
)
from kvrelay.facts.writer_process import WRITER_NICENESS
from kvrelay.testing.databases import sqlite_file_url
from tests.support.log_signal import LogSignal


def outcome(rid: str) -> Record:
    return Record(
        "outcome",
        rid,
        1,
        3.0,
        {
            "finish_reason": "stop",
            "ttft_s": 0.05,
            "inter_token_s": [0.01],
            "cached_tokens": {"gpu": 64},
            "recomputed_tokens": 5,
            "generated_tokens": 2,
            "bytes_by_tier": {},
            "attempts": 1,
            "error": None,
        },
    )


def test_the_routers_lazy_routes_are_written_as_the_candidates_they_stand_for(tmp_path: Path) -> None:
    from kvrelay.core.planning.candidates import WorkerRoute
    from kvrelay.core.router.events import Request
    from kvrelay.core.router.machine import request_chain
    from tests.support.router_driver import Driver, heartbeat, offers

    driver = Driver()
    for i in range(3):
        driver.message(heartbeat(f"w{i}", queue_delay_s=0.01 * i))
    prompt = tuple(range(300))
    chain = request_chain(driver.state, Request("r1", "m", prompt, 4))
    driver.residency("w1", "ssd", chain[:3])
    driver.residency("w2", "gpu", chain[:1])
    offers(driver.request("r1", prompt))
    (decision,) = [e for e in driver.effects if isinstance(e, Record) and e.kind == "decision"]
    lazy = {i: c for i, c in enumerate(decision.data["candidates"]) if isinstance(c, WorkerRoute)}
    assert any(c.best.terms.restore_s for c in lazy.values()), "a lazy route restores from a lower tier"
    expected = [
        (c.best.worker_id, c.best.cached_tokens, c.best.predicted_ttft_s, c.best.terms.restore_s) for c in lazy.values()
    ]
    with FactStore(sqlite_file_url(tmp_path)) as store:
        assert store.submit(decision) and store.flush(10)
        (row,) = store.reader.request_history("r1").decisions
    got = [
        (c["worker_id"], c["cached_tokens"], c["predicted_ttft_s"], c["terms"]["restore_s"])
        for c in (row.candidates[i] for i in lazy)
    ]
    assert got == expected


def test_close_drains_a_backlog_of_many_batches(tmp_path: Path) -> None:
    url = sqlite_file_url(tmp_path)
    store = FactStore(url, settings=WriterSettings(batch_size=40, buffer_size=5000))
    for i in range(1000):
        assert store.submit(outcome(f"r{i}"))
    assert store.close(timeout=60)
    stats = store.stats()
    assert (stats.written, stats.pending, stats.dropped) == (1000, 0, 0)
    assert stats.writer_busy_us > 0, "the writer reports the time it spent writing"
    with FactStore(url) as reopened:
        assert reopened.reader.request_history("r999") is not None


def test_a_killed_writer_process_is_replaced_and_facts_keep_flowing(tmp_path: Path) -> None:
    signal_lost = LogSignal("fact writer process exited with code -9")
    logger = logging.getLogger("kvrelay.facts.store")
    logger.addHandler(signal_lost)
    try:
        with FactStore(sqlite_file_url(tmp_path)) as store:
            assert store.submit(outcome("before")) and store.flush(10)
            first = store.writer_pid
            assert first is not None
            os.kill(first, signal.SIGKILL)
            assert signal_lost.seen.wait(10), "the store never noticed its writer died"
            assert store.submit(outcome("after")) and store.flush(20)
            assert store.writer_pid not in (None, first)
            assert store.reader.request_history("after") is not None
            assert store.stats().written == 2 and store.stats().pending == 0
    finally:
        logger.removeHandler(signal_lost)


def test_the_writer_runs_nicer_than_the_router_so_routing_gets_the_cpu_first(tmp_path: Path) -> None:
    with FactStore(sqlite_file_url(tmp_path)) as store:
        assert store.submit(outcome("r")) and store.flush(10)  # the writer is up and past its start
        pid = store.writer_pid
        assert pid is not None
        expected = min(os.getpriority(os.PRIO_PROCESS, 0) + WRITER_NICENESS, 19)
        assert os.getpriority(os.PRIO_PROCESS, pid) == expected


def test_items_cross_the_wire_intact_and_what_cannot_be_encoded_is_named() -> None:
    items = [outcome("r"), Record("decision", "r", 1, 1.0, {"chosen": object()}), ("not", "a record")]
    frames = FrameBuffer()
    stream = batch_frame([encode_item(i) for i in items]) + frame(b"x")
    payloads = frames.feed(stream[:7]) + frames.feed(stream[7:])
    assert len(payloads) == 2 and payloads[1] == b"x"
    good, unencodable, foreign = decode_items(payloads[0])
    assert good == outcome("r")
    assert "decision record ('r', attempt 1): cannot be sent to the fact writer" in unencodable.message
    assert foreign.message == "expected a kvrelay.core.router.events.Record, got tuple"


def test_the_replica_map_answers_by_place_in_insertion_order() -> None:
    a, b, c = b"a" * 16, b"b" * 16, b"c" * 16
    replicas = ReplicaMap()
    replicas.apply("ssd", "w1", (a, b), ())
    replicas.apply("object", "bucket", (b, a), ())
    replicas.apply("ssd", "w2", (c,), ())
    replicas.apply("ssd", "w1", (a,), ())  # a repeat changes nothing
    assert replicas.held_by("w1") == ((a, "ssd", "w1"), (b, "ssd", "w1"))
    assert replicas.of_tier("object") == ((b, "object", "bucket"), (a, "object", "bucket"))
    assert replicas.of_tier("ssd") == ((a, "ssd", "w1"), (b, "ssd", "w1"), (c, "ssd", "w2"))
    replicas.apply("ssd", "w1", (), (a, b, c))
    assert replicas.held_by("w1") == () and len(replicas) == 3
    replicas.remove(a, "object", "bucket")
    assert replicas.of_tier("object") == ((b, "object", "bucket"),) and len(replicas) == 2


def test_replica_changes_are_validated_like_single_replica_facts(tmp_path: Path) -> None:
    with FactStore(sqlite_file_url(tmp_path)) as store:
        assert store.record_replica_changes("ssd", "w1", [b"k" * 16, b"short"], [], "evicted", now=1.0)
        assert store.record_replica_changes("ssd", "w1", [b"k" * 16], [b"j" * 16], "evicted", now=2.0)
        assert store.flush(10)
        stats = store.stats()
        assert (stats.rejected, stats.written) == (1, 1)
        assert [r.location for r in store.reader.replicas_for_chain([b"k" * 16])[b"k" * 16]] == ["w1"]
