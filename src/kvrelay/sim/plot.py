"""A PNG of the TTFT distribution of each policy (empirical CDF, log time axis)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def plot_ttft(samples: Mapping[str, Sequence[float]], path: str, title: str) -> None:
    """Write the CDF of each policy's TTFT samples (seconds, any order) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for name, values in samples.items():
        ordered = sorted(v for v in values if v > 0)
        if not ordered:
            continue
        n = len(ordered)
        ax.step(ordered, [(i + 1) / n for i in range(n)], where="post", label=name, linewidth=1.2)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("share of requests")
    ax.set_title(f"TTFT distribution: {title}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
