"""Smoke test of ``bench/engines.py``: kvrelay serve and a real vLLM server on the vLLM tests' tiny Llama, one
round of every figure, the JSON and the PNG written; shapes, not speed.

Needs vLLM's venv (``make vllm``, which ``make test`` builds); skipped where it is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvrelay.launch.vllm_server import VllmNotInstalled, vllm_python
from kvrelay.testing.vllm import make_vllm_tiny_model

ROOT = Path(__file__).resolve().parents[2]
FIGURE_KEYS = {"name", "value", "unit", "baseline", "baseline_value"}

pytestmark = pytest.mark.slow


@pytest.fixture
def python() -> str:
    try:
        return vllm_python()
    except VllmNotInstalled as exc:
        pytest.skip(str(exc))


@pytest.mark.timeout(900)
def test_engines_bench_writes_every_figure_and_the_plot(tmp_path: Path, python: str) -> None:
    model = make_vllm_tiny_model(tmp_path / "tiny-llama")
    out = tmp_path / "results" / "engines.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVRELAY_")}
    env.update(KVRELAY_CACHE_DIR=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    argv = [sys.executable, str(ROOT / "bench" / "engines.py"), "--model", str(model), "--rounds", "1"]
    argv += ["--streams", "1,3", "--decode-prompt", "16", "--decode-tokens", "6", "--cold-prompt", "256"]
    argv += ["--warm-suffix", "64", "--kv-tokens", "4096", "--ttft-prompts", "2"]
    argv += ["--vllm-eager", "--vllm-python", python]
    # float32: vLLM 0.32's CPU build dies with SIGILL (its model runner exits -4) at its first bfloat16 step of this
    # model on an Intel Xeon VM with AMX (the development machine of 2026-12-02 evening); the smoke checks the
    # harness, not bfloat16.
    argv += ["--dtype", "float32"]
    argv += ["--work-dir", str(tmp_path / "work"), "--json", str(out)]
    done = subprocess.run(argv, check=False, env=env, capture_output=True, text=True, timeout=880)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    turns = [line.split()[2] for line in done.stdout.splitlines() if "TTFT cold" in line]
    assert turns == ["kvrelay", "vllm", "vllm", "kvrelay"], "two cold prompts a server, the servers taking turns"
    figures = json.loads(out.read_text())
    assert figures and all(set(f) == FIGURE_KEYS for f in figures)
    names = {f["name"] for f in figures}
    for figure in ("decode_c1_tokens_per_s", "decode_c3_tokens_per_s", "cold_ttft_s", "warm_ttft_s"):
        assert {figure, f"{figure}_ratio", f"{figure}_ratio_least", f"{figure}_ratio_largest"} <= names
    assert {"prefill_tokens_per_s", "peak_rss_mib", "vllm_prefix_cache_hit_share", "bf16_peak_gflops"} <= names
    assert {"decode_c1_share_of_compute_limit", "decode_c3_share_of_compute_limit", "warm_cached_share"} <= names
    assert {"memory_read_gbs", "decode_c1_bandwidth_floor_tokens_per_s", "decode_c1_share_of_bandwidth_floor"} <= names
    assert {"cold_ttft_compute_floor_s", "cold_ttft_share_of_compute_floor"} <= names
    assert out.with_suffix(".png").stat().st_size > 0
    assert not processes_naming(tmp_path), "the bench left a server running"


def processes_naming(path: Path) -> list[int]:
    """Live processes whose command line names ``path`` (both servers are started with paths under it)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and str(path) in (entry / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found
