"""Summaries, benchmark figures, a Markdown table and a TTFT CDF plot of trace replays.

``summarize`` turns one setup's replays into a ``Summary`` (TTFT percentiles
by linear interpolation over the requests that streamed text, pooled over the
replays; throughput over the makespans, each from the first send to the last
finish of one replay; cached tokens summed over the replays). The
figures compare ``subject`` (kvrelay's router) with each baseline setup, as
bench figures: ``{"name", "value", "unit", "baseline", "baseline_value"}``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvrelay.bench.trace.client import Measured


@dataclass(frozen=True, slots=True)
class Summary:
    requests: int
    completed: int
    errors: int
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    ttft_mean_s: float
    makespan_s: float
    requests_per_s: float
    output_tokens_per_s: float
    prompt_tokens: int
    cached_tokens: int

    @property
    def cached_share(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def answered(m: Measured) -> bool:
    """Whether the request streamed text (a TTFT) without an error."""
    return m.error is None and m.ttft_s is not None


def summarize(runs: Sequence[Sequence[Measured]]) -> Summary:
    """The summary of one setup's replays (samples pooled; makespans added); TTFT fields are NaN without samples."""
    measured = [m for run in runs for m in run]
    ok = [m for m in measured if answered(m)]
    ttfts = np.asarray([m.ttft_s for m in ok], dtype=float)
    p50, p90, p99 = np.percentile(ttfts, [50, 90, 99]) if len(ttfts) else (float("nan"),) * 3
    makespan = 0.0
    for run in runs:
        ends = [m.sent_s + m.latency_s for m in run if m.error is None and m.latency_s is not None]
        if ends:
            makespan += max(ends) - min(m.sent_s for m in run)
    out_tokens = sum(m.completion_tokens for m in ok)
    return Summary(
        requests=len(measured),
        completed=len(ok),
        errors=len(measured) - len(ok),
        ttft_p50_s=float(p50),
        ttft_p90_s=float(p90),
        ttft_p99_s=float(p99),
        ttft_mean_s=float(ttfts.mean()) if len(ttfts) else float("nan"),
        makespan_s=makespan,
        requests_per_s=len(ok) / makespan if makespan > 0 else 0.0,
        output_tokens_per_s=out_tokens / makespan if makespan > 0 else 0.0,
        prompt_tokens=sum(m.prompt_tokens for m in ok),
        cached_tokens=sum(m.cached_tokens for m in ok),
    )


def _figure(
    name: str, value: float, unit: str, baseline: str | None = None, baseline_value: float | None = None
) -> dict[str, Any]:
    return {
        "name": name,
        "value": float(value),
        "unit": unit,
        "baseline": baseline,
        "baseline_value": None if baseline_value is None else float(baseline_value),
    }


_METRICS = (
    ("ttft_p50_s", "s"),
    ("ttft_p90_s", "s"),
    ("ttft_p99_s", "s"),
    ("requests_per_s", "req/s"),
    ("output_tokens_per_s", "tok/s"),
    ("cached_tokens", "tokens"),
)


def comparison_figures(subject: str, summaries: Mapping[str, Summary]) -> list[dict[str, Any]]:
    """Per metric, the subject's value against each other setup's (one figure per pair), then each setup's errors."""
    out: list[dict[str, Any]] = []
    mine = summaries[subject]
    for attr, unit in _METRICS:
        for other, s in summaries.items():
            if other != subject:
                out.append(_figure(f"{attr}_vs_{other}", getattr(mine, attr), unit, other, getattr(s, attr)))
    for name, s in summaries.items():
        out.append(_figure(f"errors_{name}", s.errors, "requests", None, None))
    return out


CALIBRATION_GOAL = 0.09
"""The relative error per percentile the simulator should stay within: BLIS, the blackbox inference simulator
llm-d uses for capacity planning (inference-sim/inference-sim), publishes a 7 to 9 % median latency error."""


def calibration_errors(measured: Summary, simulated: Mapping[str, float]) -> dict[str, float]:
    """``|simulated - measured| / measured`` of the TTFT at p50, p90 and p99."""
    out: dict[str, float] = {}
    for q in ("p50", "p90", "p99"):
        real = getattr(measured, f"ttft_{q}_s")
        out[q] = abs(simulated[q] - real) / real if real else float("nan")
    return out


def calibration_figures(measured: Summary, simulated: Mapping[str, float]) -> list[dict[str, Any]]:
    """The simulator's predicted TTFT p50/p90/p99 against the measured ones, and the relative error of each."""
    out: list[dict[str, Any]] = []
    errors = calibration_errors(measured, simulated)
    for q in ("p50", "p90", "p99"):
        out.append(_figure(f"sim_ttft_{q}_s", simulated[q], "s", "measured kvrelay", getattr(measured, f"ttft_{q}_s")))
        out.append(_figure(f"sim_ttft_{q}_relative_error", errors[q], "1", "goal", CALIBRATION_GOAL))
    return out


def markdown(
    title: str,
    summaries: Mapping[str, Summary],
    labels: Mapping[str, str],
    notes: Sequence[str],
    simulated: Mapping[str, float] | None = None,
    per_replay: Sequence[tuple[str, int, float, Summary]] = (),
) -> str:
    """A Markdown report: one row per setup, then the simulator's prediction if given, then one row per replay
    (``(setup, round, workers' CPU availability, summary)``), then ``notes``."""
    header = "| setup | done | TTFT p50 (s) | p90 (s) | p99 (s) | req/s | out tok/s | cached prompt tokens | share |"
    lines = [f"# {title}", "", header, "|---|---|---|---|---|---|---|---|---|"]
    for name, s in summaries.items():
        lines.append(
            f"| {labels.get(name, name)} | {s.completed}/{s.requests} | {s.ttft_p50_s:.3f} | "
            f"{s.ttft_p90_s:.3f} | {s.ttft_p99_s:.3f} | {s.requests_per_s:.2f} | "
            f"{s.output_tokens_per_s:.1f} | {s.cached_tokens} | {s.cached_share:.1%} |"
        )
    if simulated is not None:
        lines.append(
            f"| simulator (kvrelay policy, calibrated) | - | {simulated['p50']:.3f} | "
            f"{simulated['p90']:.3f} | {simulated['p99']:.3f} | - | - | - | - |"
        )
        if "kvrelay" in summaries:
            e = calibration_errors(summaries["kvrelay"], simulated)
            lines.append(
                f"| simulator's error against kvrelay (goal {CALIBRATION_GOAL:.0%}) | - | {e['p50']:.1%} | "
                f"{e['p90']:.1%} | {e['p99']:.1%} | - | - | - | - |"
            )
    if per_replay:
        lines += [
            "",
            (
                "Per replay (CPU availability: the share of the workers' runnable time they had a CPU; "
                "other processes on the shared machine took the rest):"
            ),
            "",
            "| setup | round | CPU availability | TTFT p50 (s) | p90 (s) | p99 (s) | share cached |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, round_, availability, s in per_replay:
            lines.append(
                f"| {labels.get(name, name)} | {round_} | {availability:.2f} | {s.ttft_p50_s:.3f} | "
                f"{s.ttft_p90_s:.3f} | {s.ttft_p99_s:.3f} | {s.cached_share:.1%} |"
            )
    lines += ["", *notes, ""]
    return "\n".join(lines)


def plot_cdf(path: str | Path, samples: Mapping[str, Sequence[float]], labels: Mapping[str, str], title: str) -> None:
    """A PNG of each setup's empirical TTFT CDF."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, values in samples.items():
        xs = np.sort(np.asarray(values, dtype=float))
        if len(xs):
            ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=labels.get(name, name))
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("share of requests")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
