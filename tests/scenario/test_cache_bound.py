"""No policy serves more prompt tokens from cache than the trace's chunk-level infinite-cache bound."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvrelay.core.policies import POLICY_NAMES
from kvrelay.sim.cluster_config import ClusterConfig, load_cluster_config
from kvrelay.sim.replay import ReplayOptions, replay
from kvrelay.sim.trace import SYNTHETIC_VOCAB, TraceRequest, load_trace

BLOCK = 128


def _request(line: int, at_ms: float, ids: tuple[int, ...], tail: int = 40) -> TraceRequest:
    return TraceRequest(line, at_ms, BLOCK * (len(ids) - 1) + tail, 4, ids)


def collision_trace() -> list[TraceRequest]:
    """Pairs of requests whose later blocks have ids ``SYNTHETIC_VOCAB`` apart, as a trace with more than
    that many distinct ids has: the old synthesis gave such blocks identical tokens, so the second of a pair
    hit chunks that no earlier request held."""
    out: list[TraceRequest] = []
    for i in range(6):
        base = 1000 * i
        out.append(_request(2 * i + 1, 400.0 * i, (base, base + 1, base + 2)))
        far = (base, base + 1 + SYNTHETIC_VOCAB, base + 2 + SYNTHETIC_VOCAB)
        out.append(_request(2 * i + 2, 400.0 * i + 200.0, far))
    return out


def random_trace(seed: int, n: int = 24) -> list[TraceRequest]:
    """Requests that extend, branch from or repeat earlier ones, with ids drawn across the 64-bit range."""
    rng = random.Random(seed)
    out: list[TraceRequest] = []
    for line in range(1, n + 1):
        if out and rng.random() < 0.7:
            parent = rng.choice(out).hash_ids
            ids = parent[: rng.randint(1, len(parent))]
        else:
            ids = ()
        ids += tuple(rng.randrange(-(1 << 63), 1 << 63) for _ in range(rng.randint(0 if ids else 1, 3)))
        out.append(_request(line, 150.0 * line, ids, tail=rng.randint(1, BLOCK)))
    return out


def _hit_share_and_bound(trace: list[TraceRequest], policy: str) -> tuple[float, float]:
    cluster = ClusterConfig(workers=2)
    m = replay(trace, cluster, policy, ReplayOptions(block_tokens=BLOCK, start_s=1.0))
    assert m["completed"] == len(trace)
    return m["prefix_hit_share"], m["chunk_cache_bound"]


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_ids_a_vocabulary_apart_are_no_hits(policy: str) -> None:
    share, bound = _hit_share_and_bound(collision_trace(), policy)
    assert 0.0 < share <= bound + 1e-12, (share, bound)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_no_policy_exceeds_the_chunk_bound_on_random_traces(seed: int) -> None:
    print(f"trace seed {seed}")
    trace = random_trace(seed)
    for policy in POLICY_NAMES:
        share, bound = _hit_share_and_bound(trace, policy)
        assert share <= bound + 1e-12, (policy, share, bound)


def test_a_retried_request_finding_its_own_abandoned_prefill_is_no_hit() -> None:
    """Round robin on the heterogeneous cluster at 2x: slow workers' queues pass the progress timeout, the
    router retries, and the retry restores what its abandoned attempt computed and wrote through. That reuse
    is the request's own, not across requests: counted, round robin scored 229 % of the bound here."""
    root = Path(__file__).resolve().parents[2]
    trace = load_trace(root / "data/traces/mooncake_synthetic_trace.jsonl", 512, limit=300)
    cluster = load_cluster_config(root / "configs/cluster-heterogeneous.toml")
    m = replay(trace, cluster, "round_robin", ReplayOptions(rate_scale=2.0))
    assert m["router_counters"]["retries"] > 0 and m["own_attempt_cached_tokens"] > 0
    assert m["completed"] == len(trace)
    assert m["prefix_hit_share"] <= m["chunk_cache_bound"] + 1e-12, m["chunk_bound_ratio"]
