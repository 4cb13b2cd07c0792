"""Pure summaries of one measured case: latency quantiles, page occupancy, evictions, restore/decode overlap.

Inputs are plain data: the client's ``StreamRecord``s, the fact store's
``OutcomeFacts``, probe snapshots of every worker taken before and after the
case (``worker_probe``) and occupancy samples taken during it. Quantiles are
nearest-rank; a quantile of no samples is None.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvrelay.bench.facts_window import OutcomeFacts
from kvrelay.bench.streams import StreamRecord

Snapshot = dict[str, Any]
"""One probe answer (see ``worker_probe.WorkerProbe.snapshot``)."""


@dataclass(frozen=True, slots=True)
class OccupancySample:
    time: float
    """When the sampling round began (the same for every worker of a round)."""
    worker_id: str
    total: int
    free: int
    cached: int
    active: int
    """Referenced plus reserved pages."""


@dataclass(slots=True)
class CaseSummary:
    name: str
    description: str
    requests: int
    ttft_s: dict[str, float | None]
    router_ttft_s: dict[str, float | None]
    """Request arrival at the router to first token there (the fact store's measured outcomes)."""
    runtime_ttft_s: dict[str, float | None]
    """Submission to the runtime to first token, measured in the workers."""
    itl_s: dict[str, float | None]
    pages_used_peak: int
    pages_active_peak: int
    pages_total: int
    restored_bytes: dict[str, int]
    held_bytes: dict[str, int]
    cached_tokens: dict[str, int]
    recomputed_tokens: int
    evictions: dict[str, int]
    restore_s: float
    restore_overlap_s: float
    finish_reasons: dict[str, int]
    chosen_workers: dict[str, int]
    checks: dict[str, float] = field(default_factory=dict)
    """Case-specific figures (e.g. leaked pages, lost requests), by name."""
    ttft_samples: list[float] = field(default_factory=list)
    itl_samples: list[float] = field(default_factory=list)
    window: tuple[float, float] = (0.0, 0.0)

    @property
    def restore_overlap_fraction(self) -> float | None:
        return self.restore_overlap_s / self.restore_s if self.restore_s > 0 else None


def quantile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(1, math.ceil(len(ordered) * q)) - 1]


def merge_intervals(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of closed intervals as disjoint intervals, ascending."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def covered(interval: tuple[float, float], union: Sequence[tuple[float, float]]) -> float:
    """Seconds of ``interval`` covered by the disjoint intervals ``union``."""
    start, end = interval
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in union)


def restore_overlap(snapshots: Iterable[Snapshot], start: float, end: float) -> tuple[float, float, dict[str, int]]:
    """Restore seconds begun in ``[start, end]``, the part of them during which another lane of the same
    worker was decoding (between its first and last token), and the restored bytes by tier."""
    total = overlapped = 0.0
    restored: dict[str, int] = {}
    for snap in snapshots:
        decoding = merge_intervals((float(d[1]), float(d[2])) for d in snap["decode"])
        for r in snap["restores"]:
            if not start <= r["start"] <= end:
                continue
            total += r["end"] - r["start"]
            overlapped += covered((r["start"], r["end"]), decoding)
            for tier, n in r["bytes"].items():
                restored[tier] = restored.get(tier, 0) + int(n)
    return total, overlapped, restored


def runtime_first_token(snapshots: Iterable[Snapshot], start: float, end: float) -> list[float]:
    """Seconds from a job's submission to the runtime to its first token, for jobs submitted in ``[start, end]``
    (the runtime's queue and prefill; routing, admission and restore come before it)."""
    return [d[1] - d[0] for snap in snapshots for d in snap["decode"] if start <= d[0] <= end]


def eviction_delta(before: dict[str, Snapshot], after: dict[str, Snapshot]) -> dict[str, int]:
    """Evictions by ``tier:reason`` between two sets of snapshots keyed by probe URL (a process that
    started in between counts from zero; one that ended in between is not counted after its last snapshot)."""
    out: dict[str, int] = {}
    for url, snap in after.items():
        base = before.get(url, {}).get("evictions", {})
        for reason, n in snap["evictions"].items():
            out[reason] = out.get(reason, 0) + max(0, int(n) - int(base.get(reason, 0)))
    return out


def occupancy_peaks(samples: Sequence[OccupancySample], start: float, end: float) -> tuple[int, int, int]:
    """(peak used pages, peak active pages, total pages), summed over the workers of each sampling round."""
    rounds: dict[float, list[OccupancySample]] = {}
    for s in samples:
        if start <= s.time <= end:
            rounds.setdefault(s.time, []).append(s)
    used = max((sum(s.total - s.free for s in r) for r in rounds.values()), default=0)
    active = max((sum(s.active for s in r) for r in rounds.values()), default=0)
    total = max((sum(s.total for s in r) for r in rounds.values()), default=0)
    return used, active, total


def summarize_case(
    name: str,
    description: str,
    records: Sequence[StreamRecord],
    facts: OutcomeFacts,
    before: dict[str, Snapshot],
    after: dict[str, Snapshot],
    samples: Sequence[OccupancySample],
    window: tuple[float, float],
    held_bytes: dict[str, int],
) -> CaseSummary:
    """One case's summary; ``window`` brackets its measured requests, ``before`` is taken at its setup's start."""
    ttft = [t for r in records if (t := r.ttft_s) is not None]
    itl = [g for r in records for g in r.inter_token_s]
    setup_start = min((s["time"] for s in before.values()), default=window[0])
    used, active, total = occupancy_peaks(samples, setup_start, window[1])
    restore_s, overlap_s, restored = restore_overlap(after.values(), window[0], window[1])
    runtime = runtime_first_token(after.values(), window[0], window[1])
    return CaseSummary(
        name=name,
        description=description,
        requests=len(records),
        ttft_s={q: quantile(ttft, v) for q, v in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))},
        router_ttft_s={q: quantile(facts.router_ttft_s, v) for q, v in (("p50", 0.5), ("p90", 0.9))},
        runtime_ttft_s={q: quantile(runtime, v) for q, v in (("p50", 0.5), ("p90", 0.9))},
        itl_s={q: quantile(itl, v) for q, v in (("p50", 0.5), ("p99", 0.99))},
        pages_used_peak=used,
        pages_active_peak=active,
        pages_total=total,
        restored_bytes=restored,
        held_bytes=held_bytes,
        cached_tokens=facts.cached_tokens,
        recomputed_tokens=facts.recomputed_tokens,
        evictions=eviction_delta(before, after),
        restore_s=restore_s,
        restore_overlap_s=overlap_s,
        finish_reasons=facts.finish_reasons,
        chosen_workers=facts.chosen_workers,
        ttft_samples=ttft,
        itl_samples=itl,
        window=window,
    )
