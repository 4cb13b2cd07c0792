"""Smoke test of ``kvrelay sim`` on a slice of the development trace: the JSON shape, not figures."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvrelay.cli import sim as sim_cli
from kvrelay.cli.main import main
from kvrelay.core.policies import POLICY_NAMES
from kvrelay.core.router.queue import QUEUE_OFF, Limits

TRACE_HEAD = Path(__file__).resolve().parent / "data" / "mooncake_synthetic_head40.jsonl"
"""The first 40 lines of Mooncake's FAST25 synthetic trace (kvcache-ai/Mooncake, Apache-2.0)."""
FLEET = Path(__file__).resolve().parents[2] / "configs" / "cluster-vllm-fleet.toml"
"""No peer or shared tier: what a worker holds depends on where requests were routed."""


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
        reuse = metrics["reuse"]
        # Decision quality: a route captures only what the index holds, and the workers' delivered reuse is
        # exactly what the outcomes' usage reports as cached.
        assert 0 <= reuse["captured_tokens"] <= reuse["available_tokens"]
        assert reuse["delivered_tokens"] == sum(metrics["cached_tokens_by_tier"].values())
        assert isinstance(reuse["captured_share"], float) and isinstance(reuse["delivered_share"], float)
    table = capsys.readouterr().out
    assert all(name in table for name in POLICY_NAMES) and "infinite-cache bound" in table
    assert "captured" in table and "delivered" in table


def test_reuse_figures_per_policy_are_consistent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Requests sharing a 3-block prefix on workers without a shared tier: the cache-aware default captures reuse
    that round robin partly misses,
    and every policy's figures agree with each other and with the outcomes' usage."""
    trace = tmp_path / "shared.jsonl"
    rows = [
        {"timestamp": 400 * i, "input_length": 4 * 512, "output_length": 8, "hash_ids": [1, 2, 3, 100 + i]}
        for i in range(10)
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "sim.json"
    args = ["sim", "--trace", str(trace), "--workers", "4", "--seed", "5", "--config", str(FLEET), "--json", str(out)]
    assert main([*args, "--policy", "all"]) == 0
    policies = json.loads(out.read_text())["policies"]
    for name, metrics in policies.items():
        reuse = metrics["reuse"]
        assert 0 < reuse["available_tokens"], name
        assert reuse["captured_tokens"] <= reuse["available_tokens"], name
        assert reuse["delivered_tokens"] == sum(metrics["cached_tokens_by_tier"].values()), name
        assert reuse["captured_share"] == pytest.approx(reuse["captured_tokens"] / reuse["available_tokens"])
        assert reuse["delivered_share"] == pytest.approx(reuse["delivered_tokens"] / reuse["available_tokens"])
    best = policies["kvrelay"]["reuse"]
    assert best["captured_share"] > policies["round_robin"]["reuse"]["captured_share"]
    assert best["delivered_share"] > 0.5
    table = capsys.readouterr().out
    row = next(line for line in table.splitlines() if line.startswith("kvrelay "))
    assert f"{best['captured_share']:.1%}" in row and f"{best['delivered_share']:.1%}" in row


def test_bad_input_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n{"timestamp": 1}\n')
    assert main(["sim", "--trace", str(bad)]) == 2
    assert "bad.jsonl:2: missing field(s) input_length" in capsys.readouterr().err
    assert main(["sim", "--trace", str(bad), "--policy", "nope"]) == 2
    assert "policy 'nope' is unknown; known policies:" in capsys.readouterr().err


def test_the_router_queue_flags_set_its_bounds_or_turn_it_off(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    sim_cli.add_arguments(parser)
    base = ["--trace", str(TRACE_HEAD)]
    assert sim_cli.queue_limits(parser.parse_args(base)) == Limits()
    assert sim_cli.queue_limits(parser.parse_args([*base, "--no-router-queue"])) == QUEUE_OFF
    tight = parser.parse_args([*base, "--queue-max-wait-s", "5", "--queue-max-requests", "64"])
    assert sim_cli.queue_limits(tight) == Limits(max_requests=64, max_wait_s=5.0)
    assert main(["sim", *base, "--queue-max-requests", "0"]) == 2
    assert "the queue must hold at least 1 request, got 0" in capsys.readouterr().err
