"""What a run's fact store says about its routing (``bench.trace.decisions``), read from a real SQLite store that
the router's own decision and outcome records filled."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvrelay.bench.trace.decisions import by_in_flight, in_flight_points, queue_of_terms, routing_summary, slope
from kvrelay.core.router.events import Record, SendOffer
from kvrelay.facts.store import FactStore
from kvrelay.protocol.messages import Result
from kvrelay.testing.databases import sqlite_file_url
from tests.support.router_driver import Driver, heartbeat, offers


def test_requests_in_flight_are_those_decided_before_on_the_same_worker_and_not_yet_ended() -> None:
    decided = [("w0", 0.0, 1.0, 0.1), ("w0", 0.5, 2.0, 0.3), ("w1", 0.6, 0.9, 0.1), ("w0", 1.5, 3.0, 0.4)]
    points = in_flight_points(decided)
    assert points == [(0, 0.1), (1, 0.3), (0, 0.1), (1, 0.4)]  # at 1.5 the first has ended, the second has not
    assert by_in_flight(points) == {"0": 0.1, "1": pytest.approx(0.35)}
    assert slope(points) == pytest.approx(0.25)
    assert slope([(0, 0.1), (0, 0.2)]) is None
    assert by_in_flight([(5, 1.0), (3, 2.0), (4, 3.0)]) == {"3": 2.0}  # 3 and more in one group


def test_the_summary_reads_the_routers_records_from_its_store(tmp_path: Path) -> None:
    """Three requests on two engines that price a request in flight at 30 ms, each decided while the earlier ones
    still run."""
    driver = Driver()
    for wid in ("w0", "w1"):
        driver.message(heartbeat(wid, prefill_s_per_token=2e-5, decode_s_per_token=0.01, per_request_s=0.03))
    sent: list[SendOffer] = []
    for k in range(3):
        driver.now = 0.1 * k
        (offer,) = offers(driver.request(f"r{k}", tuple(range(100 * k, 100 * k + 70))))
        driver.accept(offer)
        sent.append(offer)
    for k, offer in enumerate(sent):
        driver.now = 1.0 + k
        o = offer.offer
        driver.message(
            Result(
                assignment=o.assignment,
                worker_id=o.worker_id,
                tokens=(7,),
                finish_reason="length",
            )
        )
    records = [e for e in driver.effects if isinstance(e, Record)]
    with FactStore(sqlite_file_url(tmp_path)) as store:
        assert all(store.submit(r) for r in records) and store.flush(10)
    (path,) = tmp_path.rglob("*.sqlite*")
    summary = routing_summary({"router": path})
    workers = [o.worker_id for o in sent]
    assert sum(summary["accepted_by_worker"].values()) == 3
    assert workers == ["w0", "w1", "w0"]
    # Only planned routes are recorded: the second decision planned the idle w1 alone (w0, a request in flight
    # behind, could not win), the third w0 with its first request still in flight, so only it met a queue.
    assert summary["decisions_with_a_queue"] == 1
    # The router's TTFT: arrival (0.1 k) to the first token (the result at 1 + k).
    expected = in_flight_points([(w, 0.1 * k, 1.0 + k, 1.0 + 0.9 * k) for k, w in enumerate(workers)])
    assert expected == [(0, 1.0), (0, 1.9), (1, pytest.approx(2.8))]
    assert summary["router_ttft_by_in_flight"] == {"0": pytest.approx(1.45), "1": pytest.approx(2.8)}
    assert summary["mean_router_ttft_s"] == pytest.approx(1.9)
    # every prediction (tens of ms) fell short of the measured 1.0-2.8 s; the one queued decision measured 2.8 s
    assert summary["mean_abs_prediction_error_s"] == pytest.approx(1.9 - summary["mean_predicted_ttft_s"])
    assert -2.8 < summary["queued_prediction_error_s"] < -2.5


def test_a_decisions_queue_is_read_from_its_chosen_terms() -> None:
    assert queue_of_terms('{"queue_s": 0.25, "restore_s": {}, "prefill_s": 0.1, "decode_s": 0.01}') == 0.25
    assert queue_of_terms(None) == 0.0
    assert queue_of_terms("[]") == 0.0
