"""bench/vllm_path.py's pure parts: its prompts (cold, warm, burst per target) and the split of a request's TTFT
into hops from a fact store (the bench itself starts vLLM; its figures are never asserted)."""

from __future__ import annotations

import argparse
import importlib.util
import sqlite3
import sys
from pathlib import Path
from types import ModuleType

from kvrelay.testing.tiny_models import build_tiny_tokenizer

BENCH = Path(__file__).parents[2] / "bench" / "vllm_path.py"


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_vllm_path", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
    return bench


def test_prompts_are_distinct_per_target_and_warm_ones_share_all_but_their_last_block() -> None:
    bench = load()
    args = argparse.Namespace(count=3, burst=2, bursts=2, prompt_tokens=256, max_tokens=4)
    prompts = bench.make_prompts(build_tiny_tokenizer(512), args)
    for target in bench.TARGETS:
        assert [len(prompts[phase, target]) for phase in bench.PHASES] == [3, 3, 4]
    cold = [p.token_ids for target in bench.TARGETS for p in prompts["cold", target]]
    assert len(set(cold)) == len(cold)
    for target in bench.TARGETS:
        for c, w in zip(prompts["cold", target], prompts["warm", target], strict=True):
            assert len(c.token_ids) == len(w.token_ids)
            shared = next(i for i, (a, b) in enumerate(zip(c.token_ids, w.token_ids)) if a != b)
            assert shared >= len(c.token_ids) - 64


def test_hops_split_a_kvrelay_request_on_the_monotonic_clock(tmp_path: Path) -> None:
    bench = load()
    store = tmp_path / "facts.sqlite3"
    with sqlite3.connect(store) as db:
        db.execute("CREATE TABLE decisions (request_id, attempt, time, outcome, outcome_time)")
        db.execute("CREATE TABLE outcomes (request_id, attempt, ttft_s)")
        db.execute("INSERT INTO decisions VALUES ('kv-1', 1, 10.005, 'accepted', 10.010)")
        db.execute("INSERT INTO outcomes VALUES ('kv-1', 1, 0.030)")
    sent = [
        bench.Sent("kvrelay", "cold", 10.0, 10.060, "kv-1", 0),
        bench.Sent("direct", "cold", 11.0, 11.020, "cmpl-x", 0),
    ]
    split = bench.hops(store, sent, limit_s=1.0)
    assert list(split) == ["kv-1"]
    hops = split["kv-1"]
    assert [round(hops[k], 6) for k in ("ingress", "offer", "worker", "relay")] == [0.005, 0.005, 0.03, 0.02]
    rows = bench.summary(sent, split)
    assert [(r["target"], round(r["ttft_p50"], 6)) for r in rows] == [("direct", 0.02), ("kvrelay", 0.06)]
    assert "| cold | kvrelay | 1 | 0 | 60 |" in bench.table(rows)
