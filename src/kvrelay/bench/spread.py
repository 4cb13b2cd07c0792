"""How a policy's simulated TTFT compares with the peers' over several replays of one cell (pure).

A cell is one regime at one rate; each replay of it moves the trace's arrivals
slightly (``sim.trace.jitter_arrivals``) and runs every policy on the same
moved trace. ``summarize`` gives, per figure (mean and p99 TTFT), each
policy's median over the replays and its range, the peer with the lowest
median, the *paired* ratio (in each replay, the best peer's figure of that
replay over the subject's: above 1 the subject is faster) as median and range,
and in how many replays the subject had the lowest figure of all.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum


class Stat(Enum):
    """A TTFT figure of one replay."""

    MEAN = "mean"
    P99 = "p99"


@dataclass(frozen=True, slots=True)
class Run:
    """One policy's figures in one replay of a cell."""

    policy: str
    replay: int
    mean_s: float
    p99_s: float
    completed: int

    def value(self, stat: Stat) -> float:
        return self.mean_s if stat is Stat.MEAN else self.p99_s


@dataclass(frozen=True, slots=True)
class Spread:
    """Median and range of one figure over the replays."""

    median: float
    least: float
    largest: float


@dataclass(frozen=True, slots=True)
class Comparison:
    """The subject against the peers on one figure of one cell."""

    stat: Stat
    by_policy: dict[str, Spread]
    best_peer: str
    """The peer with the lowest median."""
    ratio: Spread
    """Per replay: the lowest peer figure of that replay over the subject's (above 1: the subject is faster)."""
    wins: int
    """Replays in which the subject's figure was the lowest of all (a tie counts)."""
    replays: int


def spread(values: Sequence[float]) -> Spread:
    if not values:
        raise ValueError("a spread needs at least one value")
    return Spread(statistics.median(values), min(values), max(values))


def compare(runs: Sequence[Run], subject: str, stat: Stat) -> Comparison:
    """The subject's standing on ``stat`` over the replays in ``runs`` (every policy must have run every replay)."""
    by_replay: dict[int, dict[str, float]] = {}
    for r in runs:
        by_replay.setdefault(r.replay, {})[r.policy] = r.value(stat)
    policies = {r.policy for r in runs}
    if subject not in policies or len(policies) < 2:
        raise ValueError(f"need '{subject}' and at least one peer; got {sorted(policies)}")
    missing = [i for i, got in by_replay.items() if set(got) != policies]
    if missing:
        raise ValueError(f"replays {sorted(missing)} lack some policy's run; every policy must run every replay")
    peers = sorted(policies - {subject})
    by_policy = {p: spread([got[p] for got in by_replay.values()]) for p in sorted(policies)}
    best_peer = min(peers, key=lambda p: (by_policy[p].median, p))
    ratios = [min(got[p] for p in peers) / got[subject] for got in by_replay.values()]
    wins = sum(got[subject] <= min(got[p] for p in peers) for got in by_replay.values())
    return Comparison(stat, by_policy, best_peer, spread(ratios), wins, len(by_replay))


def summarize(runs: Sequence[Run], subject: str) -> Mapping[Stat, Comparison]:
    """``compare`` on every figure."""
    return {stat: compare(runs, subject, stat) for stat in Stat}
