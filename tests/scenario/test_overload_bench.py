"""Smoke run of ``bench/overload.py``'s simulator part on the head of the development trace: the figures it
writes, not their values."""

from __future__ import annotations

from pathlib import Path

from tests.support.bench_smoke import run_bench


def test_overload_bench_sim_smoke(tmp_path: Path) -> None:
    code, figures = run_bench("overload.py", ["--sim", "--limit", "80", "--rate-scale", "6"], tmp_path / "o.json")
    assert code == 0
    names = {f["name"] for f in figures}
    for system in ("sim_defaults", "sim_tuned"):
        assert {f"{system}_goodput_share", f"{system}_refused", f"{system}_lost"} <= names
    lost = [f for f in figures if f["name"].endswith("_lost")]
    assert all(f["value"] == 0 and f["baseline_value"] == 0 for f in lost)
