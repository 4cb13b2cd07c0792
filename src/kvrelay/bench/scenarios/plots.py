"""PNG plots of the scenarios: TTFT and inter-token latency per case, page occupancy over time, bytes by tier.

``write_plots(summaries, samples, out_dir, stem)`` writes four files named
``<stem>_<kind>.png`` into ``out_dir`` and returns {title: file name}.
matplotlib runs on its non-interactive ``Agg`` backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvrelay.bench.scenarios.stats import CaseSummary, OccupancySample
from kvrelay.protocol.messages import CACHE_TIERS

GAP_S = 2.0


def write_plots(
    summaries: Sequence[CaseSummary], samples: Sequence[OccupancySample], out_dir: Path, stem: str
) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    names = [s.name for s in summaries]
    written: dict[str, str] = {}

    def save(fig: object, kind: str, title: str) -> None:
        path = out_dir / f"{stem}_{kind}.png"
        fig.tight_layout()  # type: ignore[attr-defined]
        fig.savefig(path, dpi=110)  # type: ignore[attr-defined]
        plt.close(fig)  # type: ignore[arg-type]
        written[title] = path.name

    for kind, title, attr in (
        ("ttft", "time to first token per case", "ttft_samples"),
        ("itl", "inter-token latency per case", "itl_samples"),
    ):
        fig, ax = plt.subplots(figsize=(9, 4.5))
        data = [[v * 1000 for v in getattr(s, attr)] or [float("nan")] for s in summaries]
        ax.boxplot(data, tick_labels=names, showfliers=True, whis=(1, 99))
        ax.set_yscale("log")
        ax.set_ylabel("ms (log scale)")
        ax.set_title(title + " (whiskers p1-p99)")
        save(fig, kind, title)

    fig, ax = plt.subplots(figsize=(10, 4.5))
    start = min((s.time for s in samples), default=0.0)
    for worker_id in sorted({s.worker_id for s in samples}):
        times, used, active = _with_gaps([s for s in samples if s.worker_id == worker_id], start)
        ax.plot(times, used, label=f"{worker_id} used")
        ax.plot(times, active, linestyle=":", label=f"{worker_id} referenced + reserved")
    top = max((s.total for s in samples), default=1)
    for s in summaries:
        ax.axvspan(s.window[0] - start, s.window[1] - start, alpha=0.08, color="grey")
        ax.text(s.window[0] - start, top, s.name, ha="left", va="top", fontsize=7, rotation=90)
    ax.set_xlabel("seconds since the first sample (grey: measured window of each case)")
    ax.set_ylabel("pages")
    ax.set_title("page occupancy per worker over time")
    ax.legend(fontsize=7, loc="upper left")
    save(fig, "pages", "page occupancy over time")

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, attr, title in (
        (left, "restored_bytes", "bytes restored into pages, by source tier"),
        (right, "held_bytes", "bytes held per tier at the end of each case"),
    ):
        bottom = [0.0] * len(summaries)
        for tier in CACHE_TIERS:
            values = [getattr(s, attr).get(tier, 0) / 1e6 for s in summaries]
            if any(values):
                ax.bar(names, values, bottom=bottom, label=tier)
                bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_ylabel("MB")
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", labelrotation=30)
        if any(bottom):
            ax.legend(fontsize=7)
    save(fig, "bytes", "bytes by tier")
    return written


def _with_gaps(mine: Sequence[OccupancySample], start: float) -> tuple[list[float], list[float], list[float]]:
    """Times, used and active pages of one worker, with a break (NaN) where it was not sampled for 2 s."""
    times: list[float] = []
    used: list[float] = []
    active: list[float] = []
    for s in mine:
        if times and s.time - start - times[-1] > GAP_S:
            times.append(float("nan"))
            used.append(float("nan"))
            active.append(float("nan"))
        times.append(s.time - start)
        used.append(s.total - s.free)
        active.append(s.active)
    return times, used, active
