"""Smoke test of ``kvrelay bench scenarios``: a tiny random Gemma 3 model, tiny sizes, real processes.

It runs the whole command (router, worker processes, moto_server, SQLite) and
checks that the JSON figures, the Markdown report and the plots exist and are
well formed, and that the cases' correctness checks hold (nothing lost, no
page leaked, no request failed). It asserts no speed figure.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from kvrelay.bench.scenarios.stats import (
    covered,
    eviction_delta,
    merge_intervals,
    quantile,
    restore_overlap,
)
from kvrelay.testing.tiny_models import make_tiny_model

CASES = ("cold", "resident", "partial", "ssd", "object", "cancellation", "restart")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(240)
def test_scenarios_write_figures_report_and_plots(tmp_path: Path) -> None:
    model = make_tiny_model("gemma3", tmp_path / "tiny-gemma3", seed=3)
    out = tmp_path / "results"
    argv = [
        sys.executable,
        "-m",
        "kvrelay.cli.main",
        "--log-level",
        "WARNING",
        "bench",
        "scenarios",
        "--model",
        str(model),
        "--dtype",
        "float32",
        "--requests",
        "3",
        "--concurrency",
        "2",
        "--prefix-tokens",
        "128",
        "--suffix-tokens",
        "16",
        "--new-tokens",
        "6",
        "--kv-tokens",
        "1024",
        "--lanes",
        "4",
        "--ram-bytes",
        str(1 << 20),
        "--flood-factor",
        "1.0",
        "--out-dir",
        str(out),
        "--work-dir",
        str(tmp_path / "work"),
        "--no-progress",
    ]
    done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=220)
    assert done.returncode == 0, f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-5000:]}"

    figures = json.loads((out / "scenarios.json").read_text())
    assert isinstance(figures, list) and figures
    for figure in figures:
        assert set(figure) == {"name", "value", "unit", "baseline", "baseline_value"}, figure
        assert isinstance(figure["value"], (int, float)) and math.isfinite(figure["value"]), figure
        assert isinstance(figure["baseline_value"], (int, float)), figure
    by_name = {f["name"]: f for f in figures}
    for case in CASES:
        for quantity in (
            "ttft_p50",
            "ttft_p90",
            "ttft_p99",
            "itl_p50",
            "itl_p99",
            "recomputed_tokens",
            "pages_used_peak",
            "errors",
        ):
            assert f"{case}_{quantity}" in by_name, f"{case}_{quantity} is missing"
        assert by_name[f"{case}_ttft_p50"]["baseline"] == "cold_ttft_p50"
        assert by_name[f"{case}_errors"]["value"] == 0, f"requests failed in case {case}"
    assert by_name["cold_recomputed_tokens"]["value"] == 3 * (128 + 16)
    assert by_name["object_cached_tokens_object"]["value"] > 0
    assert by_name["cancellation_cancelled_streams"]["value"] == 1
    assert by_name["cancellation_survivors_completed"]["value"] == 2
    assert by_name["cancellation_leaked_pages"]["value"] == 0
    assert by_name["restart_lost"]["value"] == 0

    report = (out / "scenarios.md").read_text()
    assert "| case | n | TTFT p50 / p90 / p99 (ms)" in report
    for case in CASES:
        assert f"| {case} |" in report
    for kind in ("ttft", "itl", "pages", "bytes"):
        png = out / f"scenarios_{kind}.png"
        assert png.read_bytes()[:8] == PNG_MAGIC, f"{png} is not a PNG file"
        assert f"(scenarios_{kind}.png)" in report


def test_restore_overlap_counts_only_time_when_another_lane_decodes() -> None:
    assert merge_intervals([(3.0, 4.0), (0.0, 1.0), (0.5, 2.0)]) == [(0.0, 2.0), (3.0, 4.0)]
    assert covered((1.5, 3.5), [(0.0, 2.0), (3.0, 4.0)]) == pytest.approx(1.0)
    snapshot = {
        # [submitted, first token, last token, tokens]: decoding during [1, 2] and [3, 5]
        "decode": [[0.0, 1.0, 2.0, 8], [2.5, 3.0, 5.0, 8]],
        "restores": [
            {"start": 1.5, "end": 3.5, "bytes": {"ssd": 100}},  # 0.5 s + 0.5 s under decode
            {"start": 6.0, "end": 7.0, "bytes": {"object": 50}},  # nothing decodes then
            {"start": 9.0, "end": 9.5, "bytes": {"object": 7}},  # outside the window
        ],
    }
    total, overlapped, restored = restore_overlap([snapshot], 0.0, 8.0)
    assert total == pytest.approx(3.0)
    assert overlapped == pytest.approx(1.0)
    assert restored == {"ssd": 100, "object": 50}


def test_quantiles_and_eviction_deltas() -> None:
    assert quantile([], 0.5) is None
    assert quantile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.0
    assert quantile([4.0, 1.0, 3.0, 2.0], 0.99) == 4.0
    before = {"http://a": {"evictions": {"gpu:lru": 2, "ram:capacity": 5}}}
    after = {
        "http://a": {"evictions": {"gpu:lru": 7, "ram:capacity": 5}},
        "http://b": {"evictions": {"gpu:durable": 3}},
    }  # a process that started in between counts from 0
    assert eviction_delta(before, after) == {"gpu:lru": 5, "ram:capacity": 0, "gpu:durable": 3}
