"""Figures, a Markdown report and a CDF grid of ``bench/real_routers.py``: kvrelay's router against real routers.

A ``Phase`` is one engine under one load, its ``Replay``s per setup (in round order). ``figures`` gives, per
phase (names prefixed ``<engine>_<load>_``), ``kvrelay.bench.trace.report.comparison_figures`` of kvrelay
against every other setup, the engine-cached prompt tokens of each pair, and the best other setup's TTFT p90
and p99 over kvrelay's (above 1: kvrelay is faster), also over ``answered_by_all`` (suffix ``_common``).
``markdown`` leads with that verdict per phase (with the range of the same ratio over single rounds), then the same
over the requests every setup answered, then one table per phase and one row per replay.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvrelay.bench.trace.client import Measured
from kvrelay.bench.trace.report import Summary, answered, comparison_figures, summarize

SUBJECT = "kvrelay"


@dataclass(frozen=True, slots=True)
class Replay:
    setup: str
    measured: list[Measured]
    cpu_availability: float
    """The share of the workers' (engines') runnable time they had a CPU during the replay."""
    engine_cached_tokens: float
    """Prompt tokens the engines' own metrics counted as served from cache during the replay."""
    routing: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Phase:
    engine: str
    load: str
    replays: dict[str, list[Replay]]

    @property
    def prefix(self) -> str:
        return f"{self.engine}_{self.load}_"

    def summaries(self) -> dict[str, Summary]:
        return {name: summarize([r.measured for r in runs]) for name, runs in self.replays.items()}

    def engine_cached(self, setup: str) -> float:
        return sum(r.engine_cached_tokens for r in self.replays[setup])


def answered_by_all(phase: Phase) -> Phase:
    """``phase`` with only the requests (by trace index) that every replay of every setup answered, so every
    setup's percentiles are over the same requests: one a setup failed leaves every setup's figures, not only that
    setup's."""
    kept = set.intersection(
        *({m.index for m in r.measured if answered(m)} for runs in phase.replays.values() for r in runs)
    )
    replays = {
        name: [replace(r, measured=[m for m in r.measured if m.index in kept]) for r in runs]
        for name, runs in phase.replays.items()
    }
    return Phase(phase.engine, phase.load, replays)


def _figure(name: str, value: float, unit: str, baseline: str | None, baseline_value: float | None) -> dict[str, Any]:
    return {"name": name, "value": float(value), "unit": unit, "baseline": baseline, "baseline_value": baseline_value}


def best_other(
    phase: Phase, attr: str, summaries: Mapping[str, Summary] | None = None
) -> tuple[str, float, float, float]:
    """The other setup with the lowest ``attr`` (a TTFT percentile): its name, its value over kvrelay's, and the
    least and largest of that ratio over single rounds (that setup's round i against kvrelay's round i)."""
    summaries = summaries or phase.summaries()
    others = {n: getattr(s, attr) for n, s in summaries.items() if n != SUBJECT}
    name = min(others, key=lambda n: others[n])
    pooled = others[name] / getattr(summaries[SUBJECT], attr)
    rounds = []
    for mine, theirs in zip(phase.replays[SUBJECT], phase.replays[name], strict=False):
        rounds.append(getattr(summarize([theirs.measured]), attr) / getattr(summarize([mine.measured]), attr))
    return name, pooled, float(np.min(rounds)), float(np.max(rounds))


def figures(phases: Sequence[Phase]) -> list[dict[str, Any]]:
    """Every phase's figures (see the module docstring)."""
    out: list[dict[str, Any]] = []
    for phase in phases:
        summaries = phase.summaries()
        for f in comparison_figures(SUBJECT, summaries):
            out.append({**f, "name": phase.prefix + f["name"]})
        mine = phase.engine_cached(SUBJECT)
        for other in phase.replays:
            if other != SUBJECT:
                cached = phase.engine_cached(other)
                out.append(_figure(f"{phase.prefix}engine_cached_tokens_vs_{other}", mine, "tokens", other, cached))
        if len(summaries) > 1:
            common = answered_by_all(phase)
            for attr in ("ttft_p90_s", "ttft_p99_s"):
                name, ratio, _, _ = best_other(phase, attr, summaries)
                out.append(_figure(f"{phase.prefix}{attr}_best_other_over_kvrelay", ratio, "x", name, 1.0))
                name, ratio, _, _ = best_other(common, attr)
                out.append(_figure(f"{phase.prefix}{attr}_best_other_over_kvrelay_common", ratio, "x", name, 1.0))
    return out


def markdown(phases: Sequence[Phase], labels: Mapping[str, str], notes: Sequence[str]) -> str:
    """The report (see the module docstring)."""
    compared = [p for p in phases if len(p.replays) > 1]
    lines = [
        "# Real peer routers end to end: kvrelay's router against SGLang Model Gateway, vllm-router, "
        "sglang-router and round robin",
        "",
        "Best other setup's TTFT over kvrelay's (above 1: kvrelay's router is faster), pooled over the rounds "
        "[least, largest over single rounds]:",
        "",
        *_verdict(compared),
        "",
        "The same over the requests every setup answered in every round (each setup's own requests "
        "above; a request one setup failed is left out of every setup's here):",
        "",
        *_verdict([answered_by_all(p) for p in compared], common=True),
    ]
    for phase in phases:
        lines += _phase_section(phase, labels)
    lines += ["", *notes, ""]
    return "\n".join(lines)


def _verdict(phases: Sequence[Phase], common: bool = False) -> list[str]:
    columns = [
        "engine",
        "load",
        "kvrelay p90 (s)",
        "best other p90",
        "ratio",
        "kvrelay p99 (s)",
        "best other p99",
        "ratio",
    ]
    columns += ["requests"] if common else []
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for phase in phases:
        summaries = phase.summaries()
        cells = [phase.engine, phase.load]
        for attr in ("ttft_p90_s", "ttft_p99_s"):
            name, ratio, low, high = best_other(phase, attr, summaries)
            value = getattr(summaries[name], attr)
            cells += [f"{getattr(summaries[SUBJECT], attr):.3f}", f"{value:.3f} ({name})"]
            shown = f"{ratio:.2f}x [{low:.2f}, {high:.2f}]"
            cells.append(f"**{shown}**" if ratio < 1 else shown)
        if common:
            cells.append(f"{len(phase.replays[SUBJECT][0].measured)} a replay")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _phase_section(phase: Phase, labels: Mapping[str, str]) -> list[str]:
    summaries = phase.summaries()
    lines = [
        "",
        f"## {phase.engine} engine, {phase.load}",
        "",
        "| setup | done | TTFT p50 (s) | p90 (s) | p99 (s) | req/s | out tok/s | engine-cached tokens | share "
        "| usage-cached |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summaries.items():
        cached = phase.engine_cached(name)
        share = cached / s.prompt_tokens if s.prompt_tokens else 0.0
        lines.append(
            f"| {labels.get(name, name)} | {s.completed}/{s.requests} | {s.ttft_p50_s:.3f} | {s.ttft_p90_s:.3f} | "
            f"{s.ttft_p99_s:.3f} | {s.requests_per_s:.2f} | {s.output_tokens_per_s:.1f} | {cached:.0f} | "
            f"{share:.1%} | {s.cached_tokens} |"
        )
    lines += [
        "",
        "| setup | round | CPU availability | TTFT p50 (s) | p90 (s) | p99 (s) | engine-cached | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, runs in phase.replays.items():
        for i, r in enumerate(runs, start=1):
            s = summarize([r.measured])
            lines.append(
                f"| {labels.get(name, name)} | {i} | {r.cpu_availability:.2f} | {s.ttft_p50_s:.3f} | "
                f"{s.ttft_p90_s:.3f} | {s.ttft_p99_s:.3f} | {r.engine_cached_tokens:.0f} | {s.errors} |"
            )
    return lines


def plot_grid(path: str | Path, phases: Sequence[Phase], labels: Mapping[str, str]) -> None:
    """A PNG with one panel per phase: each setup's empirical TTFT CDF (samples pooled over rounds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = list(dict.fromkeys(p.engine for p in phases))
    loads = list(dict.fromkeys(p.load for p in phases))
    fig, axes = plt.subplots(
        len(engines), len(loads), figsize=(6 * len(loads), 4 * len(engines)), squeeze=False, sharey=True
    )
    for phase in phases:
        ax = axes[engines.index(phase.engine)][loads.index(phase.load)]
        for name, runs in phase.replays.items():
            xs = np.sort([m.ttft_s for r in runs for m in r.measured if answered(m)])
            if len(xs):
                ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=labels.get(name, name))
        ax.set_title(f"{phase.engine} engine, {phase.load}")
        ax.set_xlabel("time to first token (s)")
        ax.set_ylabel("share of requests")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
