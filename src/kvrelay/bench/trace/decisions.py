"""What a setup's routers decided, read back from their fact stores after a run (for diagnosis).

``routing_summary(db_files)`` reads the ``decisions`` and ``outcomes`` tables of
each SQLite fact store (a setup's router, or each ``kvrelay serve`` face) and
returns, per chosen worker, the number of accepted first attempts, and over all
decisions the mean predicted TTFT against the mean TTFT the router measured (its
outcome records: the request's arrival to its first token). Two figures
say why a routing lost (docs/performance.md, "Requests in flight as a term"):
``decisions_with_a_queue``, the decisions at which some candidate had a queue (there the
lowest score wins and the calm-cluster tie does not apply), and
``router_ttft_by_in_flight``, the median of that measured TTFT by the other requests the
same router had in flight on the chosen worker when it decided (``3`` holds 3 or more),
with ``in_flight_slope_s``, the least-squares seconds each of those added (None without
two different counts). How far the predictions were from what the router measured:
``mean_abs_prediction_error_s`` over every decision, and ``queued_prediction_error_s``, the mean
signed error (predicted less measured) over the decisions whose chosen candidate had a queue (None
without one), where a worker's account of the work it has in hand shows (docs/performance.md,
"A vLLM engine's queue aged (tried, not kept)").
Worker ids are prefixed with the store's label so faces with equal ids stay apart.
"""

from __future__ import annotations

import json
import sqlite3
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

IN_FLIGHT_TOP = 3
"""``router_ttft_by_in_flight`` puts this many requests in flight and more in one group."""

Decided = tuple[str, float, float, float]
"""``(chosen worker, decision time, outcome time, measured TTFT)`` of one attempt."""


def routing_summary(db_files: Mapping[str, Path]) -> dict[str, Any]:
    per_worker: dict[str, int] = {}
    outcomes: dict[str, int] = {}
    predicted: list[float] = []
    measured: list[float] = []
    with_queue = 0
    points: list[tuple[int, float]] = []
    queued_errors: list[float] = []
    for label, path in db_files.items():
        if not path.is_file():
            continue
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
            for worker, outcome, count in db.execute(
                "SELECT chosen_worker, outcome, COUNT(*) FROM decisions GROUP BY chosen_worker, outcome"
            ):
                outcomes[outcome] = outcomes.get(outcome, 0) + count
                if outcome == "accepted":
                    key = f"{label}/{worker}"
                    per_worker[key] = per_worker.get(key, 0) + count
            with_queue += sum(queued(text) for (text,) in db.execute("SELECT candidates FROM decisions"))
            rows = db.execute(
                "SELECT d.chosen_worker, d.time, o.time, d.predicted_ttft_s, o.ttft_s, d.terms FROM decisions d "
                "JOIN outcomes o ON d.request_id = o.request_id AND d.attempt = o.attempt "
                "WHERE d.predicted_ttft_s IS NOT NULL AND o.ttft_s IS NOT NULL"
            ).fetchall()
            predicted += [r[3] for r in rows]
            measured += [r[4] for r in rows]
            queued_errors += [r[3] - r[4] for r in rows if queue_of_terms(r[5]) > 0.0]
            points += in_flight_points([(r[0], r[1], r[2], r[4]) for r in rows])
    return {
        "accepted_by_worker": dict(sorted(per_worker.items())),
        "outcomes": dict(sorted(outcomes.items())),
        "mean_predicted_ttft_s": sum(predicted) / len(predicted) if predicted else None,
        "mean_router_ttft_s": sum(measured) / len(measured) if measured else None,
        "mean_abs_prediction_error_s": (
            statistics.fmean(abs(p - m) for p, m in zip(predicted, measured)) if predicted else None
        ),
        "queued_prediction_error_s": statistics.fmean(queued_errors) if queued_errors else None,
        "decisions_with_a_queue": with_queue,
        "router_ttft_by_in_flight": by_in_flight(points),
        "in_flight_slope_s": slope(points),
    }


def queued(candidates_json: str | None) -> bool:
    """Whether a decision's candidates (its JSON column) include one with a queue."""
    candidates = json.loads(candidates_json) if candidates_json else []
    return any(_queue_s(c.get("terms")) > 0.0 for c in candidates)


def queue_of_terms(terms_json: str | None) -> float:
    """The queue term of a decision's chosen candidate (its ``terms`` JSON column; 0 without one)."""
    return _queue_s(json.loads(terms_json) if terms_json else None)


def _queue_s(terms: object) -> float:
    """The ``queue_s`` of one candidate's decoded terms (0 where there are none)."""
    return float(terms.get("queue_s", 0.0)) if isinstance(terms, dict) else 0.0


def in_flight_points(decided: Sequence[Decided]) -> list[tuple[int, float]]:
    """``(other attempts in flight on the chosen worker at the decision, measured TTFT)`` per attempt: those
    decided before it on the same worker whose outcome came after its decision."""
    return [
        (sum(1 for w, t, end, _ in decided if w == worker and t < at < end), ttft) for worker, at, _, ttft in decided
    ]


def by_in_flight(points: Sequence[tuple[int, float]]) -> dict[str, float]:
    """The median TTFT per count in flight, counts from ``IN_FLIGHT_TOP`` up in one group (keys as strings)."""
    groups: dict[int, list[float]] = {}
    for n, ttft in points:
        groups.setdefault(min(n, IN_FLIGHT_TOP), []).append(ttft)
    return {str(n): statistics.median(groups[n]) for n in sorted(groups)}


def slope(points: Sequence[tuple[int, float]]) -> float | None:
    """The least-squares slope of TTFT on the count in flight; None without two different counts."""
    if len({n for n, _ in points}) < 2:
        return None
    return statistics.linear_regression([float(n) for n, _ in points], [t for _, t in points]).slope
