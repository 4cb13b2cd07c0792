"""Smoke test of ``bench/steady_streams.py``: kvrelay's router and smg (where ``make routers`` installed it) in
front of one real vLLM server of the tiny Llama, one short round; shapes, not speed.

Needs vLLM's venv (``make vllm``, which ``make test`` builds); skipped where it is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvrelay.bench.trace.peers import Peer, find_peer
from kvrelay.launch.vllm_server import VllmNotInstalled, vllm_python

ROOT = Path(__file__).resolve().parents[2]
FIGURE_KEYS = {"name", "value", "unit", "baseline", "baseline_value"}

pytestmark = pytest.mark.slow


@pytest.mark.timeout(400)
def test_steady_streams_writes_kvrelays_figures_against_smg(tmp_path: Path) -> None:
    try:
        vllm_python()
    except VllmNotInstalled as exc:
        pytest.skip(str(exc))
    out = tmp_path / "steady.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVRELAY_")}
    env.update(KVRELAY_CACHE_DIR=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    argv = [sys.executable, str(ROOT / "bench" / "steady_streams.py"), "--streams", "2", "--rounds", "1"]
    argv += ["--seconds", "2", "--warm-s", "0.5", "--prompt-words", "50", "--max-tokens", "4", "--json", str(out)]
    done = subprocess.run(argv, check=False, env=env, capture_output=True, text=True, timeout=380)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = {f["name"]: f for f in json.loads(out.read_text())}
    assert all(set(f) == FIGURE_KEYS for f in figures.values())
    assert figures["streams_2_errors"]["value"] == 0
    assert figures["streams_2_requests_per_s"]["value"] > 0
    assert 0 < figures["streams_2_ttft_p50_s"]["value"] <= figures["streams_2_ttft_p99_s"]["value"]
    if find_peer(Peer.SMG):
        assert figures["streams_2_ttft_p90_s"]["baseline"] == "smg"
        assert figures["streams_2_ttft_p90_s"]["baseline_value"] > 0
    else:
        assert "smg is not installed" in done.stdout
