"""Smoke test of ``bench/real_routers.py`` on the native engine: a tiny model, a tiny trace, kvrelay's router and a
real peer router (SGLang Model Gateway, where ``make routers`` installed it) under the bench's own background
load; shapes, not speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvrelay.bench.trace.peers import Peer, find_peer
from kvrelay.testing.tiny_models import make_tiny_model
from tests.integration.test_trace_e2e_smoke import FIGURE_KEYS, _trace

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(210)
def test_real_routers_writes_figures_report_and_plot(tmp_path: Path) -> None:
    model = make_tiny_model("gemma3", tmp_path / "tiny-gemma3")
    out = tmp_path / "results" / "real_routers.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVRELAY_")}
    env.update(KVRELAY_CACHE_DIR=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    argv = [sys.executable, str(ROOT / "bench" / "real_routers.py"), "--trace", str(_trace(tmp_path / "t.jsonl"))]
    argv += ["--offset", "0", "--count", "6", "--rounds", "1", "--engines", "native", "--loads", "loaded"]
    argv += ["--hog-share", "0.2", "--setups", "kvrelay,smg", "--block-tokens", "8", "--max-prompt-tokens", "64"]
    argv += ["--max-output-tokens", "2", "--time-stretch", "0.5", "--model", str(model), "--dtype", "float32"]
    argv += ["--kv-tokens", "4096", "--lanes", "4", "--timeout-s", "60", "--json", str(out)]
    done = subprocess.run(argv, check=False, env=env, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures and all(set(f) == FIGURE_KEYS for f in figures)
    names = {f["name"] for f in figures}
    errors = {f["name"]: f["value"] for f in figures if "errors_" in f["name"]}
    assert errors and all(v == 0 for v in errors.values()), errors
    report = out.with_suffix(".md").read_text()
    assert "| kvrelay router (policy kvrelay) | 6/6 |" in report
    if find_peer(Peer.SMG):
        for metric in ("ttft_p90_s", "ttft_p99_s", "engine_cached_tokens", "cached_tokens"):
            assert f"native_loaded_{metric}_vs_smg" in names
        assert "native_loaded_ttft_p99_s_best_other_over_kvrelay" in names
    else:
        assert "smg is not installed" in done.stdout
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    phases = json.loads(out.with_suffix(".requests.json").read_text())["phases"]
    assert [(p["engine"], p["load"]) for p in phases] == [("native", "loaded")]
    assert len(phases[0]["replays"]["kvrelay"][0]["measured"]) == 6
