"""The report of ``bench/engines.py``: per-round samples of both engines turned into figures, a printed
comparison and a PNG.

``Samples`` holds, per engine and figure name, one value per round. ``Comparison`` pairs kvrelay's and the
peer's values of one figure round by round: a ratio per round (``higher`` says which way is better: a rate's
ratio is kvrelay over the peer, a time's the peer over kvrelay, so above 1 kvrelay is ahead either way), and
its median, least and largest. ``figures`` writes each comparison as the median value of each side plus the
ratio's median, least and largest (``kvrelay.bench.report`` figures; the ratio's baseline is its goal where one
is set).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import TYPE_CHECKING

from kvrelay.bench.report import Figure

if TYPE_CHECKING:
    from matplotlib.axes import Axes


@dataclass
class Samples:
    """``values[engine][figure]``: one sample per round, in round order."""

    values: dict[str, dict[str, list[float]]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(list)))

    def add(self, engine: str, figure: str, value: float) -> None:
        self.values[engine][figure].append(value)

    def of(self, engine: str, figure: str) -> list[float]:
        return list(self.values[engine][figure])


@dataclass(frozen=True, slots=True)
class Comparison:
    """One figure of both engines: ``ours`` and ``theirs`` per round, in ``unit``; ``higher``: more is better."""

    name: str
    unit: str
    ours: tuple[float, ...]
    theirs: tuple[float, ...]
    higher: bool
    goal: float | None = None

    @property
    def ratios(self) -> tuple[float, ...]:
        """kvrelay's advantage per round (above 1: kvrelay ahead)."""
        better, worse = (self.ours, self.theirs) if self.higher else (self.theirs, self.ours)
        return tuple(a / b if b else float("inf") for a, b in zip(better, worse))

    @property
    def ratio(self) -> float:
        return median(self.ratios)


def figures(comparisons: list[Comparison], peer: str) -> list[Figure]:
    """Each comparison as its two medians and its ratio's median, least and largest (see the module docstring)."""
    out: list[Figure] = []
    for c in comparisons:
        out.append(Figure(c.name, median(c.ours), c.unit, peer, median(c.theirs)))
        goal = ("goal", c.goal) if c.goal is not None else (None, None)
        out.append(Figure(f"{c.name}_ratio", c.ratio, "x", *goal))
        out.append(Figure(f"{c.name}_ratio_least", min(c.ratios), "x"))
        out.append(Figure(f"{c.name}_ratio_largest", max(c.ratios), "x"))
    return out


def print_comparisons(comparisons: list[Comparison], peer: str) -> None:
    """One line per figure: both medians, kvrelay's advantage (median, least..largest) and the goal."""
    print(f"\n{'figure':34} {'kvrelay':>12} {peer:>12} {'unit':10} {'kvrelay ahead':>14}  {'spread':>13}  goal")
    for c in comparisons:
        spread = f"{min(c.ratios):.2f}..{max(c.ratios):.2f}"
        goal = "" if c.goal is None else f"{c.goal:g}x {'met' if c.ratio >= c.goal else 'NOT met'}"
        print(
            f"{c.name:34} {median(c.ours):12.4g} {median(c.theirs):12.4g} {c.unit:10} {c.ratio:13.2f}x  "
            f"{spread:>13}  {goal}"
        )


def plot(
    path: Path, decode: list[tuple[int, Comparison]], ttft: list[tuple[str, Comparison]], peer: str, title: str
) -> None:
    """Two panels: aggregate decode rate per concurrency, and TTFT per case; bars are medians, whiskers the
    least and largest round, each pair labelled with kvrelay's advantage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    streams = [f"{n} stream{'s' if n > 1 else ''}" for n, _ in decode]
    _bars(axes[0], streams, [c for _, c in decode], "tokens/s", peer)
    axes[0].set_title("aggregate decode (higher is better)")
    _bars(axes[1], [label for label, _ in ttft], [c for _, c in ttft], "seconds", peer)
    axes[1].set_title("time to first token (lower is better)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _bars(ax: Axes, labels: list[str], comparisons: list[Comparison], unit: str, peer: str) -> None:
    width = 0.38
    for side, (who, color) in enumerate((("kvrelay", "#1f77b4"), (peer, "#ff7f0e"))):
        values = [c.ours if side == 0 else c.theirs for c in comparisons]
        mids = [median(v) for v in values]
        errs = [[m - min(v) for m, v in zip(mids, values)], [max(v) - m for m, v in zip(mids, values)]]
        xs = [i + (side - 0.5) * width for i in range(len(labels))]
        ax.bar(xs, mids, width, yerr=errs, capsize=3, color=color, label=who)
    for i, c in enumerate(comparisons):
        top = max(max(c.ours), max(c.theirs))
        ax.annotate(f"{c.ratio:.2f}x", (i, top), ha="center", va="bottom", fontsize=9)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel(unit)
    ax.legend(fontsize=8)
