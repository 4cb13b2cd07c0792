"""What a setup's routers decided, read back from their fact stores after a run (for diagnosis).

``routing_summary(db_files)`` reads the ``decisions`` and ``outcomes`` tables of
each SQLite fact store (a setup's router, or each ``kvrelay serve`` face) and
returns, per chosen worker, the number of accepted first attempts, and over all
decisions the mean predicted TTFT against the mean worker-measured TTFT.
Worker ids are prefixed with the store's label so faces with equal ids stay apart.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def routing_summary(db_files: Mapping[str, Path]) -> dict[str, Any]:
    per_worker: dict[str, int] = {}
    outcomes: dict[str, int] = {}
    predicted: list[float] = []
    measured: list[float] = []
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
            rows = db.execute(
                "SELECT d.predicted_ttft_s, o.ttft_s FROM decisions d JOIN outcomes o "
                "ON d.request_id = o.request_id AND d.attempt = o.attempt "
                "WHERE d.predicted_ttft_s IS NOT NULL AND o.ttft_s IS NOT NULL"
            ).fetchall()
            predicted += [r[0] for r in rows]
            measured += [r[1] for r in rows]
    return {
        "accepted_by_worker": dict(sorted(per_worker.items())),
        "outcomes": dict(sorted(outcomes.items())),
        "mean_predicted_ttft_s": sum(predicted) / len(predicted) if predicted else None,
        "mean_worker_ttft_s": sum(measured) / len(measured) if measured else None,
    }
