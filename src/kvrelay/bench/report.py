"""Shared output of the benchmarks: a printed table and a JSON list of figures."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Figure:
    name: str
    value: float
    unit: str
    baseline: str | None = None
    baseline_value: float | None = None


def report(title: str, figures: list[Figure], json_path: str | None) -> None:
    """Print the figures as a table and, if asked, write them as JSON."""
    print(f"\n{title}")
    width = max(len(f.name) for f in figures)
    print(f"{'figure':<{width}}  {'value':>12}  {'unit':<10}  baseline")
    for f in figures:
        base = "" if f.baseline is None else f"{f.baseline}: {f.baseline_value:.6g}"
        print(f"{f.name:<{width}}  {f.value:>12.6g}  {f.unit:<10}  {base}")
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps([asdict(f) for f in figures], indent=1))
