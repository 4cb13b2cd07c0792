"""The fact writer's hot path, pure: offer outcomes folded into decisions, driver SQL, the wire's decision form."""

from __future__ import annotations

import re
from typing import Any

import pytest

from kvrelay.core.router.events import Record
from kvrelay.facts import wire
from kvrelay.facts.batch_plan import IndexedWrite, fold_offer_outcomes, plan_groups
from kvrelay.facts.records import OPS, Write, to_writes
from kvrelay.facts.statements import driver_statements, insert_columns


def decision(rid: str, attempt: int, worker: str | None, ttft: float = 0.05) -> Record:
    chosen = (
        None
        if worker is None
        else {
            "worker_id": worker,
            "route": [],
            "cached_tokens": 0,
            "predicted_ttft_s": ttft,
            "terms": {"queue_s": 0.0, "restore_s": {}, "prefill_s": ttft - 0.01, "decode_s": 0.01},
        }
    )
    data = {
        "policy": "kvrelay",
        "model": "m",
        "chosen": chosen,
        "candidates": [chosen] if chosen else [],
        "excluded": {},
    }
    return Record("decision", rid, attempt, ttft, data)


def offer(rid: str, attempt: int, worker: str, outcome: str, now: float = 9.0) -> Record:
    return Record("offer_outcome", rid, attempt, now, {"worker_id": worker, "outcome": outcome, "reason": outcome})


def indexed(records: list[Record]) -> list[IndexedWrite]:
    return [(i, w) for i, r in enumerate(records) for w in to_writes(r)]


def summary(writes: list[IndexedWrite]) -> list[tuple[Any, ...]]:
    out = []
    for index, w in writes:
        p = w.params
        if w.op == "decision":
            out.append(
                (
                    index,
                    "insert",
                    p["request_id"],
                    p["attempt"],
                    p["predicted_ttft_s"],
                    p["outcome"],
                    p["outcome_reason"],
                )
            )
        else:
            out.append((index, "update", p["p_request_id"], p["p_attempt"], p["p_outcome"]))
    return out


def test_an_outcome_folds_into_its_decision_earlier_in_the_batch_by_the_update_rule() -> None:
    batch = [
        offer("old", 1, "w1", "accepted"),  # its decision was written by an earlier batch
        decision("r", 1, "w1", 0.05),
        offer("r", 1, "w1", "declined"),
        decision("r", 1, "w1", 0.07),  # re-scored after the decline: the same worker, a lower tier
        offer("r", 1, "w1", "accepted"),
        offer("r", 1, "w1", "worker_lost"),  # after it was accepted: the latest accepted decision
        decision("r", 2, None),
        offer("q", 1, "w2", "timed_out"),  # its decision comes later: stays an update
        decision("q", 1, "w2"),
    ]
    assert summary(fold_offer_outcomes(indexed(batch))) == [
        (0, "update", "old", 1, "accepted"),
        (1, "insert", "r", 1, 0.05, "declined", "declined"),
        (3, "insert", "r", 1, 0.07, "worker_lost", "worker_lost"),
        (6, "insert", "r", 2, None, "unroutable", None),
        (7, "update", "q", 1, "timed_out"),
        (8, "insert", "q", 1, 0.05, "offered", None),
    ]


def test_folding_keeps_the_outcome_time_and_leaves_other_writes_in_place() -> None:
    batch = [decision("r", 1, "w1"), offer("r", 1, "w1", "accepted", now=7.5)]
    other = (2, Write("outcome", {"request_id": "r"}))
    folded = fold_offer_outcomes([*indexed(batch), other])
    assert folded[-1] == other and len(folded) == 2
    assert folded[0][1].params["outcome_time"] == 7.5
    groups = plan_groups(folded)
    assert [op for op, _ in groups] == sorted({"decision", "outcome"}, key=OPS.index)


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_driver_statements_bind_every_write_parameter_by_name(dialect: str) -> None:
    statements = driver_statements(dialect)
    assert set(statements) == set(OPS)
    style = r":(\w+)" if dialect == "sqlite" else r"%\((\w+)\)s"
    decision_params = to_writes(decision("r", 1, "w1"))[0].params
    assert set(re.findall(style, statements["decision"])) == set(decision_params) == set(insert_columns("decision"))
    offer_params = to_writes(offer("r", 1, "w1", "accepted"))[0].params
    assert set(re.findall(style, statements["offer_outcome"])) == set(offer_params)
    assert "RETURNING" not in " ".join(statements.values())


def test_a_decision_crosses_the_wire_without_the_fields_the_store_does_not_keep() -> None:
    record = decision("r", 1, "w1")
    record.data["pruned"] = {f"w{i}": 0.5 for i in range(60)}
    (back,) = wire.decode_items(wire.batch_frame([wire.encode_item(record)])[4:])
    assert back.data["chosen"] == record.data["chosen"] and "pruned" not in back.data


def test_a_routes_heartbeat_is_sent_as_it_was_when_the_route_was_planned() -> None:
    from kvrelay.core.planning.candidates import WorkerRoute
    from tests.support.router_driver import Driver, heartbeat

    driver = Driver()
    routes: list[WorkerRoute] = []
    for seq, prefill in enumerate((1e-4, 3e-4), start=1):
        driver.message(heartbeat("w0", seq=seq, prefill_s_per_token=prefill))
        driver.effects.clear()
        driver.request(f"r{seq}", tuple(range(seq * 1000, seq * 1000 + 200)))  # prefixes unshared: one route each
        (record,) = [e for e in driver.effects if isinstance(e, Record) and e.kind == "decision"]
        routes += [c for c in record.data["candidates"] if isinstance(c, WorkerRoute)]
    assert len(routes) == 2 and routes[0].heartbeat is not routes[1].heartbeat
    for route in routes:
        item = Record(
            "decision",
            "r",
            1,
            1.0,
            {"policy": "p", "model": "m", "chosen": None, "candidates": [route], "excluded": {}},
        )
        (back,) = wire.decode_items(wire.batch_frame([wire.encode_item(item)])[4:])
        assert back.data["candidates"][0].best == route.best
    assert routes[0].best.terms.prefill_s * 3 == pytest.approx(routes[1].best.terms.prefill_s)
