"""``kvrelay explain`` on histories written through a real FactStore (SQLite file and PostgreSQL)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from kvrelay.cli import explain as explain_command
from kvrelay.cli import main as cli
from kvrelay.core.router.events import Record
from kvrelay.facts import explain
from kvrelay.facts.store import FactStore
from kvrelay.testing.databases import sqlite_file_url


def cand(
    worker: str,
    route: list[list[Any]],
    cached: int,
    queue: float,
    restore: dict[str, float],
    prefill: float,
    decode: float = 0.025,
) -> dict[str, Any]:
    return {
        "worker_id": worker,
        "route": route,
        "cached_tokens": cached,
        "predicted_ttft_s": queue + sum(restore.values()) + prefill + decode,
        "terms": {"queue_s": queue, "restore_s": restore, "prefill_s": prefill, "decode_s": decode},
    }


W1_GPU = cand("w1", [["gpu", 4]], 256, 0.010, {}, 0.005)
W2_SSD = cand("w2", [["ssd", 4]], 256, 0.002, {"ssd": 0.020}, 0.005)
W3_ALL = cand("w3", [], 0, 0.000, {}, 0.030)
W2_PEER = cand("w2", [["peer", 2, "w1"]], 128, 0.002, {"peer": 0.004}, 0.018)


def write_history(url: str) -> None:
    """Attempt 1: w1 declines, the re-score picks w2 whose offer times out; attempt 2: w2 accepts."""

    def decision(attempt: int, now: float, chosen: dict[str, Any], candidates: list[dict[str, Any]]) -> Record:
        data = {
            "policy": "kvrelay",
            "model": "tiny",
            "chosen": chosen,
            "candidates": candidates,
            "excluded": {"w4": "no_capacity: needs 40 pages, 12 free", "w5": "wrong epoch"},
            "extra": 1,
        }
        return Record("decision", "req-7", attempt, now, data)

    def offer(attempt: int, now: float, worker: str, outcome: str, reason: str | None) -> Record:
        data = {"worker_id": worker, "outcome": outcome, "reason": reason}
        return Record("offer_outcome", "req-7", attempt, now, data)

    with FactStore(url) as store:
        for record in [
            decision(1, 100.0, W1_GPU, [W1_GPU, W2_SSD, W3_ALL]),
            offer(1, 100.01, "w1", "declined", "stale_route"),
            decision(1, 100.01, W2_SSD, [W2_SSD, W3_ALL]),
            offer(1, 102.01, "w2", "timed_out", "no answer in 2.0 s"),
            decision(2, 102.01, W2_PEER, [W3_ALL, W2_PEER]),
            offer(2, 102.02, "w2", "accepted", None),
            Record(
                "outcome",
                "req-7",
                2,
                103.0,
                {
                    "finish_reason": "length",
                    "ttft_s": 2.09,
                    "inter_token_s": [0.02, 0.03, 0.025],
                    "cached_tokens": {"peer": 128},
                    "recomputed_tokens": 100,
                    "generated_tokens": 4,
                    "bytes_by_tier": {"peer": 2_097_152},
                    "attempts": 2,
                    "error": None,
                },
            ),
        ]:
            assert store.submit(record)
        assert store.flush(10)
        assert store.stats().written == 7


def run_explain(request_id: str, db: str | None) -> int:
    parser = argparse.ArgumentParser()
    explain_command.add_arguments(parser)
    return explain_command.run(parser.parse_args([request_id] + (["--db", db] if db else [])))


def test_explain_prints_candidates_winner_losers_offers_and_outcome(
    fact_db_url: str,
    capsys: pytest.CaptureFixture[str],  # noqa: F811
) -> None:
    write_history(fact_db_url)
    assert run_explain("req-7", fact_db_url) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "request req-7: 2 attempt(s), 3 decision(s)"
    assert lines[1:3] == [
        "attempt 1",
        "  decision 1 at t=100.000 (policy kvrelay, model tiny): 3 candidates, 2 excluded",
    ]
    assert lines[3:6] == [
        "    * w1 [gpu x4]: cached 256 tokens, predicted TTFT 40.0 ms = queue 10.0 ms, restore 0.0 ms, "
        "prefill 5.0 ms, decode 25.0 ms",
        "    - w2 [ssd x4]: cached 256 tokens, predicted TTFT 52.0 ms = queue 2.0 ms, restore 20.0 ms (ssd 20.0 ms), "
        "prefill 5.0 ms, decode 25.0 ms",
        "    - w3 [recompute all]: cached 0 tokens, predicted TTFT 55.0 ms = queue 0.0 ms, restore 0.0 ms, "
        "prefill 30.0 ms, decode 25.0 ms",
    ]
    assert lines[6:12] == [
        "    winner: w1 [gpu x4], predicted TTFT 40.0 ms",
        "    lost: w2 [ssd x4]: predicted TTFT +12.0 ms higher (queue -8.0 ms, restore +20.0 ms)",
        "    lost: w3 [recompute all]: predicted TTFT +15.0 ms higher (queue -10.0 ms, prefill +25.0 ms)",
        "    excluded: w4: no_capacity: needs 40 pages, 12 free",
        "    excluded: w5: wrong epoch",
        "    offer: declined by w1 (stale_route) at t=100.010",
    ]
    assert "    offer: timed out by w2 (no answer in 2.0 s) at t=102.010" in lines
    assert lines.index("attempt 2") > lines.index("    offer: timed out by w2 (no answer in 2.0 s) at t=102.010")
    assert (
        "    * w2 [peer@w1 x2]: cached 128 tokens, predicted TTFT 49.0 ms = queue 2.0 ms, restore 4.0 ms "
        "(peer 4.0 ms), prefill 18.0 ms, decode 25.0 ms" in lines
    )
    assert (
        "    lost: w3 [recompute all]: predicted TTFT +6.0 ms higher (queue -2.0 ms, restore -4.0 ms, "
        "prefill +12.0 ms)" in lines
    )
    assert lines[-6:] == [
        "    offer: accepted by w2 at t=102.020",
        "measured outcome (attempt 2, 2 attempt(s) in all): finish length",
        "  TTFT: measured 2090.0 ms vs predicted 49.0 ms (+2041.0 ms, +4165%)",
        "  inter-token latency over 3 gaps: mean 25.0 ms, p50 25.0 ms, p99 30.0 ms, max 30.0 ms",
        "  tokens: cached by tier peer 128; recomputed 100; generated 4",
        "  bytes moved by tier: peer 2097152 B",
    ]


def test_an_unknown_request_exits_1_with_a_clear_message(
    fact_db_url: str,
    capsys: pytest.CaptureFixture[str],  # noqa: F811
) -> None:
    write_history(fact_db_url)
    assert run_explain("req-404", fact_db_url) == 1
    err = capsys.readouterr().err
    assert "request 'req-404' has no recorded decisions or outcome in" in err


def test_the_default_database_is_the_data_dir_file_and_a_missing_one_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.COMMANDS["explain"][0] == explain_command.__name__
    monkeypatch.setenv("KVRELAY_DATA_DIR", str(tmp_path / "data"))
    assert run_explain("req-7", None) == 1
    assert f"no fact store at {tmp_path / 'data' / 'facts.sqlite3'}; pass --db URL" in capsys.readouterr().err
    write_history(sqlite_file_url(tmp_path / "data"))
    assert run_explain("req-7", None) == 0
    assert "winner: w1 [gpu x4], predicted TTFT 40.0 ms" in capsys.readouterr().out


def test_an_unroutable_decision_and_an_unanswered_offer_are_said_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = sqlite_file_url(tmp_path)
    with FactStore(url) as store:
        store.submit(
            Record(
                "decision",
                "r",
                1,
                1.0,
                {
                    "policy": "kvrelay",
                    "model": "m",
                    "chosen": None,
                    "candidates": [],
                    "excluded": {"w1": "model not served"},
                },
            )
        )
        store.submit(
            Record(
                "decision",
                "r",
                2,
                2.0,
                {"policy": "kvrelay", "model": "m", "chosen": W3_ALL, "candidates": [W3_ALL], "excluded": {}},
            )
        )
        assert store.flush(10)
    assert run_explain("r", url) == 0
    out = capsys.readouterr().out
    unroutable = "    winner: none (no worker could take the request)\n    excluded: w1: model not served\n"
    assert unroutable + "    offer: none sent\n" in out
    assert "    offer: sent to w3; no answer recorded" in out
    assert out.endswith("measured outcome: not recorded yet\n")


def test_why_lost_names_ties_and_other_policies_rules() -> None:
    assert explain.why_lost(W1_GPU, W1_GPU, "kvrelay") == "same predicted TTFT; lost the deterministic tie-break"
    assert explain.why_lost(W1_GPU, W2_SSD, "sglang_cache_aware") == (
        "predicted TTFT 12.0 ms lower, but policy 'sglang_cache_aware' chose by its own rule"
    )


def test_the_real_routers_records_are_stored_and_explained(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.support.router_driver import Driver, heartbeat, offers

    driver = Driver()
    driver.message(heartbeat("w0"))
    driver.message(heartbeat("w1"))
    first = offers(driver.request("r1", tuple(range(300))))[0]
    second = offers(driver.decline(first, "stale_route"))[0]
    driver.accept(second)
    driver.result(second.offer.assignment, second.worker_id, (5, 6, 7, 8))
    records = [e for e in driver.effects if isinstance(e, Record)]
    url = sqlite_file_url(tmp_path)
    with FactStore(url) as store:
        for record in records:
            assert store.submit(record)
        assert store.flush(10)
        assert (store.stats().written, store.stats().rejected) == (len(records), 0)
    assert run_explain("r1", url) == 0
    out = capsys.readouterr().out
    assert f"winner: {first.worker_id} [" in out and f"offer: declined by {first.worker_id}" in out
    assert f"offer: accepted by {second.worker_id}" in out and "measured outcome" in out


def test_why_lost_names_the_work_term_when_a_quicker_start_loses_on_score() -> None:
    winner = {**W1_GPU, "predicted_ttft_s": 0.541, "score_s": 0.542}
    quicker = {**W2_SSD, "predicted_ttft_s": 0.533, "score_s": 1.046}
    assert explain.why_lost(quicker, winner, "kvrelay") == (
        "predicted TTFT 8.0 ms lower, but its score was 504.0 ms higher: it recomputes more on a busy "
        "cluster (the score adds weighted prefill seconds)"
    )


def test_explain_takes_a_response_id_as_the_router_request_id() -> None:
    from kvrelay.cli.explain import router_request_id

    assert router_request_id("cmpl-kv-0123abcd") == "kv-0123abcd"
    assert router_request_id("chatcmpl-kv-0123abcd") == "kv-0123abcd"
    assert router_request_id("kv-0123abcd") == "kv-0123abcd"
