"""The fault checker fires on each broken invariant and stays quiet on a clean schedule (synthetic records)."""

from __future__ import annotations

from typing import Any

from kvrelay.testing.counting_model import WORDS, expected_tokens, word_prompt, words_of
from kvrelay.testing.invariants import OUTCOME_LINGER_S, End, Outcome, Snapshot, check
from kvrelay.testing.streams import StreamRecord

PROMPT = word_prompt(10, 70)
N = 8


def text_of(tokens: list[int]) -> str:
    return " ".join(WORDS[t - 3] for t in tokens)


def record(index: int = 0, tokens: list[int] | None = None, **fields: Any) -> StreamRecord:
    tokens = expected_tokens(PROMPT, N) if tokens is None else tokens
    r = StreamRecord(index, PROMPT, N, started_at=0.0, ended_at=1.0, status=200, done_markers=1)
    r.response_id = f"cmpl-kv-{index:020d}"
    r.pieces = [text_of(tokens)]
    r.finishes = ["length"]
    r.usage = {"completion_tokens": len(tokens)}
    for name, value in fields.items():
        setattr(r, name, value)
    return r


def quiet(records: list[StreamRecord], **fields: Any) -> Snapshot:
    workers = {
        "w1": {
            "reservations": 0,
            "runs": 0,
            "pages": {"reserved": 0, "referenced": 0},
            "keys": {"gpu": ["aa"], "ram": ["aa", "bb"], "ssd": []},
        }
    }
    snap = Snapshot(
        router={
            "requests": [],
            "queued": [],
            "index": {"workers": {"w1": {"gpu": ["aa"], "ram": ["bb"], "ssd": []}}, "object": ["cc"]},
        },
        workers=workers,
        object_keys={"cc", "dd"},
        outcomes={r.request_id: Outcome("length", N, None) for r in records if r.request_id},
        finished=len(records),
    )
    for name, value in fields.items():
        setattr(snap, name, value)
    return snap


def test_the_counting_models_words_spell_its_tokens() -> None:
    tokens = expected_tokens(word_prompt(len(WORDS) - 3, 2), 4)
    assert tokens == [255, 3, 4, 5]  # wraps around the cycle to the first word
    assert words_of(text_of(tokens)) == tokens


def test_a_clean_schedule_has_no_violation() -> None:
    records = [record(0), record(1)]
    verdict = check(records, quiet(records))
    assert verdict.violations == []
    assert verdict.count(End.COMPLETED) == 2


def test_each_broken_client_invariant_is_named() -> None:
    good = expected_tokens(PROMPT, N)
    cases = {
        "never ended": record(ended_at=None),
        "ended 2 times": record(finishes=["length", "length"]),
        "finished 'error' without saying why": record(finishes=["error"], tokens=good[:3]),
        "[DONE] markers": record(done_markers=0),
        "not the continuation's": record(tokens=good[:3] + good[2:7]),
        "completed with 7 tokens": record(tokens=good[:7]),
        "went silent": record(transport_error="ReadTimeout: timed out"),
        "without an error message": record(status=503, errors=[""]),
    }
    for expected, broken in cases.items():
        verdict = check([broken], quiet([broken]))
        assert any(expected in v for v in verdict.violations), (expected, verdict.violations)


def test_a_duplicated_token_is_counted() -> None:
    good = expected_tokens(PROMPT, N)
    verdict = check([rec := record(tokens=good[:4] + good[3:7])], quiet([rec]))
    assert verdict.duplicated_tokens == 1


def test_clear_errors_are_failures_not_violations() -> None:
    records = [
        record(0, status=503, errors=["no worker serves model 'x' right now"], response_id=None, finishes=[]),
        record(1, transport_error="RemoteProtocolError: peer closed connection", tokens=expected_tokens(PROMPT, 3)),
    ]
    records[1].finishes = []
    verdict = check(records, quiet(records, router_restarted=True, finished=None, outcomes={}))
    assert verdict.violations == []
    assert verdict.count(End.FAILED) == 2


def test_a_request_that_ended_just_before_its_router_was_killed_may_lack_its_outcome() -> None:
    """The fact store sends what it buffered every 0.2 s: a ``kill -9`` right after a stream completed may lose
    that outcome, one long after may not."""
    records = [record(0)]  # ended at 1.0
    lost_in_the_linger = quiet(records, outcomes={}, router_restarted=True, finished=None, router_killed_at=1.5)
    assert check(records, lost_in_the_linger).violations == []
    lost_long_after = quiet(
        records, outcomes={}, router_restarted=True, finished=None, router_killed_at=1.0 + OUTCOME_LINGER_S + 1
    )
    assert any("has no outcome" in v for v in check(records, lost_long_after).violations)


def test_each_broken_cluster_invariant_is_named() -> None:
    records = [record(0)]
    leftovers = quiet(records)
    leftovers.workers["w1"]["reservations"] = 1
    stale_index = quiet(records)
    stale_index.router["index"]["workers"]["w1"]["ram"] = ["ee"]
    dead = quiet(records)
    dead.router["index"]["workers"]["w9"] = {"ssd": ["ff"]}
    cases = {
        "not quiet": leftovers,
        "does not hold": stale_index,
        "not live": dead,
        "not in the bucket": quiet(records, object_keys=set()),
        "has no outcome": quiet(records, outcomes={}),
        "fact store says 'error'": quiet(records, outcomes={records[0].request_id: Outcome("error", 0, "x")}),
        "the router finished 2": quiet(records, finished=2),
        "still holds requests": quiet(records, router={**quiet(records).router, "requests": ["kv-1"]}),
    }
    for expected, snapshot in cases.items():
        verdict = check(records, snapshot)
        assert any(expected in v for v in verdict.violations), (expected, verdict.violations)
