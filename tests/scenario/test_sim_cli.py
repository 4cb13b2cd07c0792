"""Smoke test of ``kvrelay sim`` on a slice of the development trace: the JSON shape, not figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvrelay.cli.main import main
from kvrelay.core.policies import POLICY_NAMES

TRACE_HEAD = Path(__file__).resolve().parent / "data" / "mooncake_synthetic_head40.jsonl"
"""The first 40 lines of Mooncake's FAST25 synthetic trace (kvcache-ai/Mooncake, Apache-2.0)."""


def test_policy_all_writes_the_documented_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sim.json"
    rc = main(
        [
            "sim",
            "--trace",
            str(TRACE_HEAD),
            "--workers",
            "2",
            "--policy",
            "all",
            "--limit",
            "12",
            "--seed",
            "3",
            "--rate-scale",
            "2",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    doc = json.loads(out.read_text())
    assert (doc["trace"], doc["workers"], doc["seed"]) == (str(TRACE_HEAD), 2, 3)
    assert set(doc["policies"]) == set(POLICY_NAMES)
    for metrics in doc["policies"].values():
        assert metrics["requests"] == 12 and isinstance(metrics["completed"], int)
        assert set(metrics["ttft_s"]) == {"mean", "p50", "p90", "p99"}
        assert all(isinstance(v, float) for v in metrics["ttft_s"].values())
        assert isinstance(metrics["prefix_hit_share"], float)
        assert isinstance(metrics["infinite_cache_bound"], float)
        assert isinstance(metrics["recomputed_tokens"], int)
    table = capsys.readouterr().out
    assert all(name in table for name in POLICY_NAMES) and "infinite-cache bound" in table


def test_bad_input_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n{"timestamp": 1}\n')
    assert main(["sim", "--trace", str(bad)]) == 2
    assert "bad.jsonl:2: missing field(s) input_length" in capsys.readouterr().err
    assert main(["sim", "--trace", str(bad), "--policy", "nope"]) == 2
    assert "policy 'nope' is unknown; known policies:" in capsys.readouterr().err
