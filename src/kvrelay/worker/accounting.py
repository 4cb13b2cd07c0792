"""What a worker reports of one run (usage and timings) and the restore rates it learns, for heartbeats."""

from __future__ import annotations

from kvrelay.protocol.messages import Tier, Timings, Usage
from kvrelay.worker.handlers import RestoreReport, Run


def usage_of(run: Run) -> Usage:
    """Prompt tokens by where they came from (cached per tier, the rest recomputed) and tokens generated."""
    cached = sum(run.cached_tokens.values())
    return Usage(
        prompt_tokens=len(run.offer.prompt),
        cached_tokens=dict(run.cached_tokens),
        recomputed_tokens=len(run.offer.prompt) - cached,
        generated_tokens=len(run.generated),
    )


def timings_of(run: Run) -> Timings:
    """Queue, restore, prefill and first-token times of a run, and its gaps between tokens."""
    times = run.token_times
    return Timings(
        queue_s=max(0.0, run.submitted_at - run.accepted_at - run.restore_s),
        restore_s=run.restore_s,
        prefill_s=(times[0] - run.submitted_at) if times else 0.0,
        ttft_s=(times[0] - run.accepted_at) if times else 0.0,
        inter_token_s=tuple(b - a for a, b in zip(times, times[1:])),
    )


def learn_restore_rates(rates: dict[Tier, float], report: RestoreReport) -> None:
    """Fold one restore into the moving averages of restore bytes per second per tier (in place)."""
    if report.seconds <= 0:
        return
    total = sum(report.bytes_by_tier.values())
    for tier, nbytes in report.bytes_by_tier.items():
        if nbytes < 1 << 16:
            continue
        rate = total / report.seconds
        old = rates.get(tier)
        rates[tier] = rate if old is None else 0.8 * old + 0.2 * rate
