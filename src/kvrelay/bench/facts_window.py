"""The router's measured outcomes and decisions of one time window, read from its fact store.

The router records with ``time.monotonic()``, the clock every process of the
machine shares, so a benchmark brackets a case with the same clock and reads
the rows whose ``time`` falls inside. The router's writer is asynchronous:
``outcomes`` waits (bounded) until at least ``expect`` rows are visible.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from kvrelay.facts import schema
from kvrelay.facts.engine import make_engine

WAIT_S = 15.0


@dataclass(frozen=True, slots=True)
class OutcomeFacts:
    """What the fact store says of a window's requests."""

    finish_reasons: dict[str, int]
    cached_tokens: dict[str, int]
    recomputed_tokens: int
    attempts_over_one: int
    gpu_hit_requests: dict[int, int]
    """Requests by the number of prompt tokens they found resident on the gpu tier."""
    chosen_workers: dict[str, int]
    """Accepted offers by worker."""
    rows: int
    router_ttft_s: list[float]
    """Time to first token as the router measured it (request arrival to first token at the router)."""


class FactsWindow:
    def __init__(self, db_url: str) -> None:
        self.engine = make_engine(db_url)

    def read(self, start: float, end: float, expect: int) -> OutcomeFacts:
        """Outcomes and accepted decisions recorded in ``[start, end]`` (waiting up to ``WAIT_S`` for ``expect``
        outcomes, and for the store's tables, which the router's writer process creates when it gets to it)."""
        o, d = schema.outcomes, schema.decisions
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                with self.engine.connect() as conn:
                    rows = conn.execute(sa.select(o).where(o.c.time >= start, o.c.time <= end)).all()
                    chosen = conn.execute(
                        sa.select(d.c.chosen_worker, sa.func.count())
                        .where(d.c.time >= start, d.c.time <= end, d.c.outcome == "accepted")
                        .group_by(d.c.chosen_worker)
                    ).all()
            except sa.exc.OperationalError:
                if time.monotonic() > deadline:
                    raise
                threading.Event().wait(0.2)
                continue
            if len(rows) >= expect or time.monotonic() > deadline:
                break
            threading.Event().wait(0.2)
        return summarize(rows, {str(w): int(n) for w, n in chosen})

    def close(self) -> None:
        self.engine.dispose()


def summarize(rows: Sequence[Any], chosen: dict[str, int]) -> OutcomeFacts:
    finish: dict[str, int] = {}
    cached: dict[str, int] = {}
    hits: dict[int, int] = {}
    recomputed = retried = 0
    ttft: list[float] = []
    for row in rows:
        if row.ttft_s is not None:
            ttft.append(float(row.ttft_s))
        finish[row.finish_reason] = finish.get(row.finish_reason, 0) + 1
        for tier, n in (row.cached_tokens or {}).items():
            cached[tier] = cached.get(tier, 0) + int(n)
        gpu = int((row.cached_tokens or {}).get("gpu", 0))
        hits[gpu] = hits.get(gpu, 0) + 1
        recomputed += int(row.recomputed_tokens)
        retried += int(row.attempts > 1)
    return OutcomeFacts(finish, cached, recomputed, retried, hits, chosen, len(rows), ttft)
