"""Smoke test of ``bench/trace_e2e.py``: a tiny model, a tiny trace, every setup end to end; shapes, not speed.

The sglang-router setup runs only where ``sglang-router`` is installed (not in
CI); elsewhere the script leaves it out and says so, which this test checks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvrelay.bench.trace.peers import Peer, find_peer
from kvrelay.testing.tiny_models import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]
FIGURE_KEYS = {"name", "value", "unit", "baseline", "baseline_value"}


def _trace(path: Path) -> Path:
    """Six requests; the later ones share the first ones' leading blocks (ids chain like Mooncake's)."""
    lines = [(0, [0, 1, 2]), (50, [3, 4]), (100, [0, 1, 5]), (150, [3, 4, 6]), (200, [0, 1, 2, 7]), (250, [8])]
    path.write_text(
        "".join(
            json.dumps({"timestamp": t, "input_length": 512 * len(ids), "output_length": 3, "hash_ids": ids}) + "\n"
            for t, ids in lines
        )
    )
    return path


@pytest.mark.timeout(210)
def test_trace_e2e_writes_figures_report_and_plot(tmp_path: Path) -> None:
    model = make_tiny_model("gemma3", tmp_path / "tiny-gemma3")
    out = tmp_path / "results" / "trace_e2e.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVRELAY_")}
    env.update(KVRELAY_CACHE_DIR=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    argv = [
        sys.executable,
        str(ROOT / "bench" / "trace_e2e.py"),
        "--trace",
        str(_trace(tmp_path / "t.jsonl")),
        "--offset",
        "0",
        "--count",
        "6",
        "--rounds",
        "1",
        "--block-tokens",
        "8",
        "--max-prompt-tokens",
        "64",
        "--max-output-tokens",
        "2",
        "--time-stretch",
        "0.5",
        "--model",
        str(model),
        "--dtype",
        "float32",
        "--kv-tokens",
        "4096",
        "--lanes",
        "4",
        "--calibration",
        str(ROOT / "configs" / "calibration-gemma3-270m-cpu.toml"),
        "--timeout-s",
        "60",
        "--json",
        str(out),
    ]
    done = subprocess.run(argv, check=False, env=env, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures and all(set(f) == FIGURE_KEYS for f in figures)
    names = {f["name"] for f in figures}
    baselines = ["round_robin"] + (["sglang_cache_aware"] if find_peer(Peer.SGLANG_ROUTER) else [])
    for other in baselines:
        for metric in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "requests_per_s", "cached_tokens"):
            assert f"{metric}_vs_{other}" in names
    if not find_peer(Peer.SGLANG_ROUTER):
        assert "sglang-router is not installed" in done.stdout
        assert not any(n.endswith("sglang_cache_aware") for n in names)
    assert {"sim_ttft_p50_s", "sim_ttft_p90_s", "sim_ttft_p50_relative_error"} <= names
    errors = {f["name"]: f["value"] for f in figures if f["name"].startswith("errors_")}
    assert errors and all(v == 0 for v in errors.values()), errors
    cached = next(f for f in figures if f["name"] == "cached_tokens_vs_round_robin")
    assert cached["value"] >= 0 and cached["baseline_value"] >= 0
    report = out.with_suffix(".md").read_text()
    assert "| kvrelay router (policy kvrelay) | 6/6 |" in report
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    per_request = json.loads(out.with_suffix(".requests.json").read_text())
    assert len(per_request["requests"]["kvrelay"][0]) == 6
