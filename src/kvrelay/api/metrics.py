"""Prometheus text exposition of the ingress's counters and histograms (no client library needed).

``Metrics`` keeps monotonically growing counters and fixed-bucket histograms,
keyed by name and label set; gauges are read at render time from callables,
so ``/metrics`` always shows the pool's current pages.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
Labels = tuple[tuple[str, str], ...]


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def observe(self, value: float) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1


class Metrics:
    def __init__(self) -> None:
        self.counters: dict[str, dict[Labels, float]] = {}
        self.histograms: dict[str, dict[Labels, Histogram]] = {}
        self.gauges: dict[str, Callable[[], dict[Labels, float]]] = {}
        self.kinds: dict[str, str] = {}
        self.help: dict[str, str] = {}

    def inc(self, name: str, value: float = 1.0, help_: str = "", **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        series = self.counters.setdefault(name, {})
        series[key] = series.get(key, 0.0) + value
        self.help.setdefault(name, help_)

    def observe(self, name: str, value: float, help_: str = "", **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        self.histograms.setdefault(name, {}).setdefault(key, Histogram(LATENCY_BUCKETS)).observe(value)
        self.help.setdefault(name, help_)

    def gauge(self, name: str, read: Callable[[], dict[Labels, float]], help_: str = "", kind: str = "gauge") -> None:
        """A series read at render time; ``kind="counter"`` for a monotonic count kept elsewhere."""
        self.gauges[name] = read
        self.help[name] = help_
        self.kinds[name] = kind

    def render(self) -> str:
        lines: list[str] = []
        for name, series in sorted(self.counters.items()):
            lines += [f"# HELP {name} {self.help.get(name, '')}", f"# TYPE {name} counter"]
            lines += [f"{name}{_fmt(labels)} {value:g}" for labels, value in sorted(series.items())]
        for name, read in sorted(self.gauges.items()):
            lines += [f"# HELP {name} {self.help.get(name, '')}", f"# TYPE {name} {self.kinds.get(name, 'gauge')}"]
            lines += [f"{name}{_fmt(labels)} {value:g}" for labels, value in sorted(read().items())]
        for name, hists in sorted(self.histograms.items()):
            lines += [f"# HELP {name} {self.help.get(name, '')}", f"# TYPE {name} histogram"]
            for labels, h in sorted(hists.items()):
                running = 0
                for bound, count in zip((*h.buckets, float("inf")), h.counts):
                    running += count
                    le = "+Inf" if bound == float("inf") else f"{bound:g}"
                    lines.append(f"{name}_bucket{_fmt((*labels, ('le', le)))} {running}")
                lines.append(f"{name}_sum{_fmt(labels)} {h.total:g}")
                lines.append(f"{name}_count{_fmt(labels)} {h.n}")
        return "\n".join(lines) + "\n"


def _fmt(labels: Labels) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{v.replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
                     for k, v in labels)
    return "{" + inner + "}"
