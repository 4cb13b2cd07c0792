"""A smoke run of ``bench/soak.py`` on the shared namespace cluster: two short rounds, judged by the checker."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from kvrelay.testing.invariants import End
from kvrelay.testing.netns_cluster import LabCluster

pytestmark = [pytest.mark.netns, pytest.mark.timeout(900)]


def test_soak_rounds_inject_their_faults_and_keep_the_invariants(lab: LabCluster, tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("bench_soak", Path(__file__).parents[2] / "bench" / "soak.py")
    assert spec is not None and spec.loader is not None
    soak = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = soak  # its dataclasses look their module up
    try:
        spec.loader.exec_module(soak)
    finally:
        sys.modules.pop(spec.name, None)
    args = soak.parse(["--minutes", "0", "--round-s", "8", "--rate", "1", "--kinds", "loss", "freeze"])
    lines: list[str] = []
    result = soak.run_soak(lab, 7, args, lines.append)
    assert sorted(r.kind for r in result.rounds) == ["freeze", "loss"]
    assert result.violations() == [], "\n".join(lines)
    assert result.count(End.LOST) == 0 and result.count(End.COMPLETED) > 0
    text = soak.markdown(result, "bench/soak.py --seed 7")
    assert "| lost | 0 | requests |" in text and "Seed 7" in text
    soak.plot(result, str(tmp_path / "soak.png"))
    assert (tmp_path / "soak.png").stat().st_size > 0
