"""Deterministic replay: same seed and input, byte-identical event log; another seed, another log."""

from __future__ import annotations

import hashlib
from pathlib import Path

from kvrelay.sim.cluster_config import load_cluster_config
from kvrelay.sim.interpreter import Simulation
from kvrelay.sim.replay import ReplayOptions, replay, with_workers
from kvrelay.sim.trace import load_trace
from tests.scenario.scenario_kit import (
    assert_invariants,
    request,
    small_cluster,
    tokens,
)

TRACE_HEAD = Path(__file__).resolve().parent / "data" / "mooncake_synthetic_head40.jsonl"
"""The first 40 lines of Mooncake's FAST25 synthetic trace (kvcache-ai/Mooncake, Apache-2.0)."""


def faulty_run(seed: int) -> Simulation:
    sim = Simulation(small_cluster(workers=3, loss=0.02), seed=seed)
    for i in range(6):
        sim.submit(request(f"r{i}", tokens(1, 640) + tokens(10 + i, 100 + 7 * i), 30), at=0.5 + 0.05 * i)
    sim.crash("w1", at=0.9, restart_after=0.5)
    sim.partition("w2", "router", start=0.7, end=1.2)
    sim.cancel("r5", at=0.95)
    assert sim.run(until=600.0)
    return sim


def test_same_seed_gives_a_byte_identical_log_and_another_seed_does_not() -> None:
    a, b, c = faulty_run(21), faulty_run(21), faulty_run(22)
    for sim in (a, b, c):
        assert_invariants(sim)
    log_a = a.log_bytes()
    print("seed 21 log sha256", hashlib.sha256(log_a).hexdigest(), "lines", log_a.count(b"\n"))
    assert log_a.count(b"\n") > 200
    assert log_a == b.log_bytes()
    assert log_a != c.log_bytes()


def test_trace_replay_is_deterministic() -> None:
    requests = load_trace(TRACE_HEAD, limit=40)
    cluster = with_workers(load_cluster_config(), 4)
    runs = [replay(requests, cluster, "kvrelay", ReplayOptions(seed=s)) for s in (1, 1)]
    for m in runs:
        m.pop("wall_s")
    assert runs[0] == runs[1]
    assert runs[0]["completed"] == 40


def test_log_does_not_depend_on_the_process_hash_seed() -> None:
    import os
    import subprocess
    import sys

    code = (
        "import hashlib; from tests.scenario.test_deterministic_replay import faulty_run; "
        "print(hashlib.sha256(faulty_run(21).log_bytes()).hexdigest())"
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == hashlib.sha256(faulty_run(21).log_bytes()).hexdigest()
