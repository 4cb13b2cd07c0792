"""The peer routers' policies on hand-built contexts: each one's distinctive behaviour.

Every heartbeat here (tests.support.router_driver.heartbeat) has 1000 pages of
16 tokens, 64-token chunks, kv_bytes_per_token = 1000 (64,000 bytes a chunk),
1 ms prefill per token, a 20 ms decode step, and restore rates ram 1e9, ssd
2.5e8, peer 5e8, object 1e8 bytes/s. PROMPT has 513 tokens: 8 cacheable
chunks plus the last token; a Dynamo block is one chunk, so the request is
513 / 64 = 8.015625 prefill blocks and ceil(513 / 64) = 9 blocks in all.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from kvrelay.core.planning import candidates as cand
from kvrelay.core.planning import predicted_ttft
from kvrelay.core.planning.index import ResidencyIndex
from kvrelay.core.policies import POLICY_NAMES, make_policy
from kvrelay.core.policies.base import RoutingContext
from kvrelay.core.policies.dynamo_kv import DynamoKV
from kvrelay.core.policies.kvrelay_ttft import PredictedTTFT
from kvrelay.core.policies.llmd_affinity import LlmdAffinity
from kvrelay.core.policies.llmd_scorer import LlmdScorer
from kvrelay.core.policies.mooncake_conductor import MooncakeConductor
from kvrelay.core.policies.sglang_cache_aware import (
    ApproximateTree,
    SGLangCacheAware,
)
from kvrelay.core.policies.smg_cache_aware import SmgCacheAware, SmgKvEvents
from kvrelay.core.router.events import Request
from kvrelay.protocol.chunk_keys import prompt_chain
from kvrelay.protocol.messages import Heartbeat
from tests.support.router_driver import Driver, offers
from tests.support.router_driver import heartbeat as idle_heartbeat

PROMPT = tuple(range(1, 64 * 8 + 2))
CHAIN = prompt_chain(b"m", PROMPT, 64)
PEERS = ("smg_cache_aware", "smg_kv_events", "sglang_cache_aware", "dynamo", "llm_d", "llm_d_scorers", "mooncake")


def heartbeat(worker_id: str, **overrides: object) -> Heartbeat:
    """A worker that is decoding (one 20 ms decode step per prefill iteration, prompts in one iteration)."""
    return idle_heartbeat(worker_id, **{"active_lanes": 1, **overrides})


def context(
    workers: list[Heartbeat],
    residency: Sequence[tuple[str, str, int]] = (),
    loads: dict[str, predicted_ttft.WorkerLoad] | None = None,
    prompt: tuple[int, ...] = PROMPT,
    now: float = 0.0,
    seed: int = 0,
) -> RoutingContext:
    """A routing context for ``prompt`` with ``(worker, tier, leading chunks)`` residency."""
    chain = prompt_chain(b"m", prompt, 64)
    index = ResidencyIndex()
    for wid, tier, n in residency:
        index.store(wid, tier, chain[:n])
    loads = loads or {}
    views = [
        predicted_ttft.WorkerView(
            hb,
            loads.get(hb.worker_id, predicted_ttft.WorkerLoad(restore_backlog_s=hb.lower_tier_load_s)),
            predicted_ttft.reported_fingerprints(hb),
        )
        for hb in workers
    ]
    plan = cand.plan("m", len(prompt), 4, chain, b"m", 64, views, index)
    return RoutingContext(
        Request("r", "m", prompt, 4),
        prompt,
        chain,
        64,
        plan,
        {v.heartbeat.worker_id: v for v in views},
        random.Random(seed),
        now,
        now,
    )


def idle(*ids: str) -> list[Heartbeat]:
    return [heartbeat(w) for w in ids]


def active(n: int) -> predicted_ttft.WorkerLoad:
    return predicted_ttft.WorkerLoad(active=n)


def test_every_peer_policy_is_registered_and_routes_through_the_router() -> None:
    assert set(PEERS) <= set(POLICY_NAMES)
    for name in PEERS:
        assert make_policy(name).name == name
        d = Driver(policy=name)
        d.message(heartbeat("w0"))
        d.message(heartbeat("w1"))
        (offer,) = offers(d.request("r", PROMPT))
        assert offer.worker_id in {"w0", "w1"}


# --- SGLang cache_aware -----------------------------------------------------------


def test_sglang_routes_a_repeated_prefix_back_to_the_worker_it_routed_without_residency() -> None:
    d = Driver(policy="sglang_cache_aware")
    for w in ("w0", "w1", "w2"):
        d.message(heartbeat(w))
    (first,) = offers(d.request("r1", PROMPT))
    again = PROMPT[:400] + tuple(range(90_000, 90_113))  # 400 / 513 = 0.78 shared > 0.3
    for i in range(5):
        (offer,) = offers(d.request(f"r{i + 2}", again))
        assert offer.worker_id == first.worker_id
    assert len(d.state.index) == 0  # no residency event was ever sent


def test_sglang_below_the_threshold_picks_the_smallest_tree() -> None:
    policy = SGLangCacheAware()
    policy.tree.insert(PROMPT, "w0", 0.0)  # 513 tokens
    policy.tree.insert(tuple(range(50_000, 50_100)), "w1", 0.0)  # 100 tokens
    policy.tree.insert(tuple(range(60_000, 60_300)), "w2", 0.0)  # 300 tokens
    low_overlap = PROMPT[:150] + tuple(range(70_000, 70_363))  # 150 / 513 = 0.29 <= 0.3
    chosen = policy.choose(context(idle("w0", "w1", "w2"), prompt=low_overlap))
    assert chosen is not None and chosen.worker_id == "w1"
    above = PROMPT[:160] + tuple(range(70_000, 70_353))  # 160 / 513 = 0.31 > 0.3
    chosen = policy.choose(context(idle("w0", "w1", "w2"), prompt=above))
    assert chosen is not None and chosen.worker_id == "w0"


@pytest.mark.parametrize(
    ("loads", "winner"),
    [
        ({"w0": 100, "w1": 10, "w2": 30}, "w1"),  # 90 > 64 and 100 > 15: imbalanced -> least loaded
        ({"w0": 70, "w1": 10, "w2": 30}, "w0"),  # 60 <= 64: balanced -> cache
        ({"w0": 300, "w1": 230, "w2": 250}, "w0"),  # 70 > 64 but 300 <= 345: balanced -> cache
    ],
)
def test_sglang_falls_back_to_least_loaded_only_under_imbalance(loads: dict[str, int], winner: str) -> None:
    policy = SGLangCacheAware()
    policy.tree.insert(PROMPT, "w0", 0.0)
    ctx = context(idle("w0", "w1", "w2"), loads={w: active(n) for w, n in loads.items()})
    chosen = policy.choose(ctx)
    assert chosen is not None and chosen.worker_id == winner


def test_sglang_ignores_residency_it_did_not_route() -> None:
    policy = SGLangCacheAware()
    policy.tree.insert(PROMPT, "w0", 0.0)
    ctx = context(idle("w0", "w1"), residency=[("w1", "gpu", 8)])
    chosen = policy.choose(ctx)
    assert chosen is not None and chosen.worker_id == "w0"
    assert PredictedTTFT().choose(ctx).worker_id == "w1"  # type: ignore[union-attr]


def test_sglang_inserts_at_selection_time_and_forgets_a_restarted_worker() -> None:
    policy = SGLangCacheAware()
    ctx = context(idle("w0"))
    chosen = policy.choose(ctx)
    assert chosen is not None
    policy.on_routed(ctx, chosen)
    assert policy.tree.match(PROMPT) == {"w0": 513} and policy.tree.size("w0") == 513
    policy.choose(context([heartbeat("w0", epoch=2)]))
    assert policy.tree.match(PROMPT) == {} and policy.tree.size("w0") == 0


def test_tree_evicts_least_recently_used_leaves_of_an_oversized_tenant_only() -> None:
    tree = ApproximateTree()
    tree.insert((1, 2, 3, 4), "t", 0.0)
    tree.insert((1, 2, 5, 6), "t", 1.0)
    tree.insert((1, 2, 3, 4), "u", 2.0)
    assert tree.size("t") == 6 and tree.size("u") == 4
    tree.evict(4)
    assert tree.size("t") == 4 and tree.size("u") == 4
    assert tree.match((1, 2, 3, 4)) == {"t": 2, "u": 4}
    assert tree.match((1, 2, 5, 6)) == {"t": 4, "u": 2}
    tree.evict(1)
    assert tree.size("t") == 0 and tree.size("u") == 0 and tree.match((1, 2, 3, 4)) == {}


def test_sglang_evicts_on_its_interval_with_its_bound() -> None:
    policy = SGLangCacheAware(max_tree_size=150, eviction_interval_s=10.0)
    for now, prompt in ((0.0, PROMPT[:80]), (5.0, tuple(range(900, 980))), (10.0, tuple(range(2000, 2050)))):
        ctx = context(idle("w0"), prompt=prompt, now=now)
        policy.on_routed(ctx, ctx.plan.routes[0].best)
    assert policy.tree.size("w0") == 50 + 80  # the 80-token prompt routed at 0.0 went first
    assert policy.tree.match(PROMPT[:80]) == {}


# --- SGLang Model Gateway (smg) cache_aware ------------------------------------------


def test_smg_sends_a_miss_to_the_least_loaded_worker_not_the_smallest_tree() -> None:
    policy = SmgCacheAware()
    policy.tree.insert(tuple(range(50_000, 50_100)), "w1", 0.0)  # w1 has the smallest tree ...
    loads = {"w0": active(3), "w1": active(5), "w2": active(2)}  # ... w2 the fewest requests in flight
    chosen = policy.choose(context(idle("w0", "w1", "w2"), loads=loads))
    assert chosen is not None and chosen.worker_id == "w2"
    assert SGLangCacheAware().choose(context(idle("w0", "w1", "w2"), loads=loads)) is not None


def test_smg_ties_on_load_go_to_the_worker_it_routed_fewer_requests_to() -> None:
    policy = SmgCacheAware()
    ctx = context(idle("w0", "w1"))
    for _ in range(2):
        policy.on_routed(ctx, ctx.plan.routes[0].best)  # w0 got two requests, now finished
    miss = tuple(range(80_000, 80_513))
    chosen = policy.choose(context(idle("w0", "w1"), prompt=miss))
    assert chosen is not None and chosen.worker_id == "w1"


def test_smg_a_hit_goes_to_the_last_worker_that_inserted_at_the_deepest_node() -> None:
    policy = SmgCacheAware()
    policy.tree.insert(PROMPT, "w0", 1.0)
    policy.tree.insert(PROMPT, "w1", 2.0)
    chosen = policy.choose(context(idle("w0", "w1", "w2"), loads={"w1": active(9)}))
    assert chosen is not None and chosen.worker_id == "w1"  # load does not matter while balanced
    assert policy.tree.deepest_tenant(PROMPT[:200]) == (200, "w1")
    assert policy.tree.deepest_tenant((99_999,)) == (0, None)


def test_smg_kv_events_takes_the_largest_device_overlap_then_the_lower_load() -> None:
    policy = SmgKvEvents()
    residency = [("w0", "gpu", 3), ("w1", "gpu", 6), ("w2", "gpu", 6), ("w2", "ram", 8)]
    loads = {"w1": active(4), "w2": active(1)}
    chosen = policy.choose(context(idle("w0", "w1", "w2"), residency=residency, loads=loads))
    assert chosen is not None and chosen.worker_id == "w2"
    nothing = policy.choose(context(idle("w0", "w1"), residency=[("w0", "ram", 8)], loads={"w0": active(1)}))
    assert nothing is not None and nothing.worker_id == "w1"  # a host copy is no device overlap: least loaded


# --- llm-d: prefix-cache-affinity filter, token-load scorer --------------------------


def test_llmd_sticks_to_the_worker_it_routed_the_prefix_to_until_the_ttft_gate_breaks() -> None:
    policy = LlmdAffinity()
    ctx = context(idle("w0", "w1"))
    policy.on_routed(ctx, next(r for r in ctx.routes if r.worker_id == "w0").best)
    busy = {"w0": predicted_ttft.WorkerLoad(outstanding_s=5.0)}  # 5,000 tokens in flight: 5 s at 1 ms a token
    chosen = policy.choose(context(idle("w0", "w1"), loads=busy))
    assert chosen is not None and chosen.worker_id == "w0"  # sticky (8/8 >= 0.8), 5 s behind < 18 s
    swamped = {"w0": predicted_ttft.WorkerLoad(outstanding_s=19.0)}
    chosen = policy.choose(context(idle("w0", "w1"), loads=swamped))
    assert chosen is not None and chosen.worker_id == "w1"  # 19 s behind: every worker, the lighter wins


def test_llmd_below_the_affinity_threshold_takes_the_lightest_token_load() -> None:
    policy = LlmdAffinity()
    ctx = context(idle("w0", "w1"))
    policy.on_routed(ctx, next(r for r in ctx.routes if r.worker_id == "w0").best)
    half = PROMPT[: 6 * 64] + tuple(range(90_000, 90_129))  # 6 of 8 blocks: 0.75 < 0.8
    loads = {"w0": predicted_ttft.WorkerLoad(outstanding_s=0.5), "w1": predicted_ttft.WorkerLoad(outstanding_s=0.1)}
    scores = policy.scores(context(idle("w0", "w1"), loads=loads, prompt=half))
    assert scores["w0"].prefix == pytest.approx(0.75) and scores["w1"].prefix == 0.0
    assert scores["w0"].token_load == pytest.approx(1 - 500 / 4_194_304)
    chosen = policy.choose(context(idle("w0", "w1"), loads=loads, prompt=half))
    assert chosen is not None and chosen.worker_id == "w1"


def test_llmd_forgets_the_least_recently_routed_blocks_beyond_the_devices_capacity() -> None:
    policy = LlmdAffinity()
    small = [heartbeat("w0", pages_total=40)]  # 40 pages of 16 tokens: 10 chunks
    ctx = context(small)
    policy.on_routed(ctx, ctx.plan.routes[0].best)  # 8 blocks
    other = tuple(range(70_000, 70_513))
    ctx2 = context(small, prompt=other)
    policy.on_routed(ctx2, ctx2.plan.routes[0].best)  # 8 more: the first prompt's oldest 6 go
    assert policy.index.matched("w0", CHAIN) == 0 and policy.index.matched("w0", ctx2.chain) == 8


# --- Dynamo KV router ---------------------------------------------------------------


def test_dynamo_prefers_a_device_hit_over_host_and_disk_hits_of_the_same_length() -> None:
    policy = DynamoKV()
    ctx = context(idle("w0", "w1", "w2"), residency=[("w0", "ssd", 8), ("w1", "ram", 8), ("w2", "gpu", 8)])
    costs = {r.worker_id: policy.cost(ctx, r) for r in ctx.routes}
    # disk: credit 8 * 0.25 = 2 -> 6.015625 prefill blocks, 9 new blocks
    assert costs["w0"].overlap_credit == pytest.approx(2.0) and costs["w0"].logit == pytest.approx(15.015625)
    # host: credit 8 * 0.75 = 6 -> 2.015625 prefill blocks, 9 new blocks
    assert costs["w1"].overlap_credit == pytest.approx(6.0) and costs["w1"].logit == pytest.approx(11.015625)
    # device: credit 8 -> 0.015625 prefill blocks, 1 new block (the last token's)
    assert costs["w2"].overlap_credit == pytest.approx(8.0) and costs["w2"].logit == pytest.approx(1.015625)
    assert policy.choose(ctx).worker_id == "w2"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("pages_in_use", "inflight", "winner"),
    [
        (63, 0, "w0"),  # 63 * 16 / 64 = 15.75 active blocks: 0.015625 + 15.75 + 1 = 16.765625 < 17.015625
        (65, 0, "w1"),  # 16.25 active blocks: 17.265625 > 17.015625
        (0, 65, "w1"),  # the router's own in-flight pages count the same
    ],
)
def test_dynamo_trades_overlap_against_decode_load_per_its_formula(
    pages_in_use: int, inflight: int, winner: str
) -> None:
    warm = heartbeat("w0", pages_free=1000 - pages_in_use)
    ctx = context(
        [warm, heartbeat("w1")],
        residency=[("w0", "gpu", 8)],
        loads={"w0": predicted_ttft.WorkerLoad(inflight_pages=inflight)},
    )
    policy = DynamoKV()
    cold = policy.cost(ctx, next(r for r in ctx.routes if r.worker_id == "w1"))
    assert cold.logit == pytest.approx(8.015625 + 9)  # no credit, 9 new blocks
    assert policy.choose(ctx).worker_id == winner  # type: ignore[union-attr]


def test_dynamo_prefill_load_scale_and_outstanding_prefill_enter_the_prefill_term() -> None:
    # w0: 80 pages in use = 20 active blocks; w1: 64 ms of outstanding prefill = 64 queued tokens.
    ctx = context(
        [heartbeat("w0", pages_free=920), heartbeat("w1")],
        residency=[("w0", "gpu", 8)],
        loads={"w1": predicted_ttft.WorkerLoad(outstanding_s=0.064)},
    )
    scaled = DynamoKV(prefill_load_scale=2.0)
    w0, w1 = (scaled.cost(ctx, r) for r in sorted(ctx.routes, key=lambda r: r.worker_id))
    assert w1.raw_prefill_blocks == pytest.approx((64 + 513) / 64)
    assert w0.logit == pytest.approx(2 * 0.015625 + 20 + 1)  # 21.03125
    assert w1.logit == pytest.approx(2 * (577 / 64) + 9)  # 27.03125
    assert scaled.choose(ctx).worker_id == "w0"  # type: ignore[union-attr]
    default = DynamoKV()
    w0, w1 = (default.cost(ctx, r) for r in sorted(ctx.routes, key=lambda r: r.worker_id))
    assert (w0.logit, w1.logit) == pytest.approx((21.015625, 18.015625))
    assert default.choose(ctx).worker_id == "w1"  # type: ignore[union-attr]


def test_dynamo_gives_no_credit_for_a_peer_copy_and_breaks_ties_by_worker_id() -> None:
    policy = DynamoKV()
    ctx = context(idle("w1", "w0"), residency=[("w1", "ram", 8)])
    w0 = next(r for r in ctx.routes if r.worker_id == "w0")
    assert [s.tier for s in w0.segments] == ["peer"] and policy.cost(ctx, w0).overlap_credit == 0.0
    for seed in range(5):
        assert policy.choose(context(idle("w1", "w0"), seed=seed)).worker_id == "w0"  # type: ignore[union-attr]


# --- llm-d --------------------------------------------------------------------------


def test_llmd_weighted_sum_on_a_hand_computed_case() -> None:
    workers = [
        heartbeat("w0", pages_free=600, pages_evictable=100, active_lanes=1),
        idle_heartbeat("w1", pages_free=900),
        idle_heartbeat("w2"),
    ]
    residency = [("w0", "gpu", 4), ("w0", "ram", 6), ("w1", "ssd", 8)]
    ctx = context(workers, residency, loads={"w0": active(3), "w1": active(5)})
    scores = LlmdScorer().scores(ctx)
    # prefix: (4 * 1.0 + 2 * 0.8) / 8 = 0.7; 8 * 0.3 / 8 = 0.3; w2 only reaches peers: 0
    assert [scores[w].prefix for w in ("w0", "w1", "w2")] == pytest.approx([0.7, 0.3, 0.0])
    # waiting 2, 5, 0 -> (5 - q) / (5 - 0)
    assert [scores[w].queue for w in ("w0", "w1", "w2")] == pytest.approx([0.6, 0.0, 1.0])
    # used (1000 - 600 - 100) / 1000, 100 / 1000, 0
    assert [scores[w].kv_free for w in ("w0", "w1", "w2")] == pytest.approx([0.7, 0.9, 1.0])
    # 3 * prefix + 2 * queue + 2 * kv
    assert [scores[w].total for w in ("w0", "w1", "w2")] == pytest.approx([4.7, 2.7, 4.0])
    assert LlmdScorer().choose(ctx).worker_id == "w0"  # type: ignore[union-attr]
    assert LlmdScorer(prefix_weight=1.0).choose(ctx).worker_id == "w2"  # type: ignore[union-attr]


def test_llmd_equal_queues_score_one_and_scores_stay_in_unit_range() -> None:
    ctx = context(
        [heartbeat("w0", pages_free=40), heartbeat("w1")],
        residency=[("w0", "gpu", 8)],
        loads={"w0": active(4), "w1": active(4)},
    )
    scores = LlmdScorer().scores(ctx)
    assert scores["w0"].queue == scores["w1"].queue == 1.0
    for s in scores.values():
        assert 0.0 <= s.prefix <= 1.0 and 0.0 <= s.queue <= 1.0 and 0.0 <= s.kv_free <= 1.0


# --- Mooncake Conductor --------------------------------------------------------------


@pytest.mark.parametrize(
    ("threshold", "cached", "ttft"),
    [
        (3.0, 512, 6 * 64000 / 5e8 + 1e-3 + 0.02),  # 8 / 2 = 4 >= 3: fetch the 6 peer chunks
        (5.0, 128, (513 - 128) * 1e-3 + 0.02),  # 4 < 5: prefill from the 2 local chunks
    ],
)
def test_mooncake_threshold_switches_between_local_and_remote_reuse(threshold: float, cached: int, ttft: float) -> None:
    workers = [heartbeat("w0"), heartbeat("w1", queue_delay_s=5.0)]
    ctx = context(workers, residency=[("w0", "gpu", 2), ("w1", "ram", 8)])
    chosen = MooncakeConductor(threshold).choose(ctx)
    assert chosen is not None and chosen.worker_id == "w0"
    assert chosen.cached_tokens == cached and chosen.predicted_ttft_s == pytest.approx(ttft)
    assert ("peer" in chosen.tiers) == (cached == 512)


def test_mooncake_fetches_whenever_it_has_no_local_prefix_and_keeps_a_complete_local_one() -> None:
    ctx = context(idle("w0", "w1"), residency=[("w1", "ram", 8)])
    policy = MooncakeConductor(kvcache_balancing_threshold=100.0)
    routes = {r.worker_id: r for r in ctx.routes}
    assert policy.fetches_remote(routes["w0"]) and not policy.fetches_remote(routes["w1"])
    cold = policy.candidate(ctx, routes["w0"])
    assert cold is not None and cold.cached_tokens == 512 and cold.tiers == frozenset({"peer"})


def test_mooncake_fetches_past_the_threshold_even_when_recompute_would_be_faster() -> None:
    slow_peer = heartbeat("w0", restore_bytes_per_s={"peer": 1e5})  # 0.64 s a chunk, 64 ms to recompute it
    ctx = context([slow_peer, heartbeat("w1", queue_delay_s=9.0)], residency=[("w0", "gpu", 2), ("w1", "ram", 8)])
    chosen = MooncakeConductor(2.0).choose(ctx)
    assert chosen is not None and chosen.worker_id == "w0" and chosen.cached_tokens == 512
    assert chosen.predicted_ttft_s == pytest.approx(6 * 0.64 + 1e-3 + 0.02)
    best = PredictedTTFT().choose(ctx)
    assert best is not None and best.cached_tokens == 128  # kvrelay weighs the fetch against recompute


@pytest.mark.parametrize(("fixed_s", "busy", "winner"), [(0.04, 0.0, "w1"), (0.2, 0.0, "w0"), (0.04, 0.5, "w0")])
def test_kvrelay_takes_the_resident_prefix_when_the_scores_are_within_the_affinity_margin(
    fixed_s: float, busy: float, winner: str
) -> None:
    """w1 holds one chunk but reports a higher fixed cost per request: on a calm cluster 20 ms more is within
    the margin (the cached tokens win) and 180 ms more is not; on a busy one the lowest score wins."""
    fast = {"prefill_s_per_token": 1e-4, "decode_s_per_token": 0.02}
    workers = [idle_heartbeat("w0", **fast), idle_heartbeat("w1", **{**fast, "decode_s_per_token": fixed_s})]
    ctx = context(workers, residency=[("w1", "gpu", 1)])._replace(busy_share=busy)
    scores = {r.worker_id: r.best_score for r in ctx.plan.routes}
    assert scores["w0"] < scores["w1"]  # the lowest score alone would recompute on w0
    chosen = PredictedTTFT().choose(ctx)
    assert chosen is not None and chosen.worker_id == winner
    assert chosen.cached_tokens == (64 if winner == "w1" else 0)


@pytest.mark.parametrize(("w0_active", "w1_active", "winner"), [(1, 1, "w1"), (1, 2, "w0"), (0, 3, "w0"), (2, 1, "w1")])
def test_kvrelay_takes_the_tie_on_the_workers_with_the_fewest_requests_in_flight(
    w0_active: int, w1_active: int, winner: str
) -> None:
    """w1 holds one chunk and the scores tie within the margin: the cached tokens win among the workers with the
    fewest requests in flight, not over a worker running fewer (what those requests cost a new one is outside the
    score)."""
    fast = {"prefill_s_per_token": 1e-4, "decode_s_per_token": 0.02}
    workers = [idle_heartbeat("w0", **fast), idle_heartbeat("w1", **fast)]
    loads = {"w0": active(w0_active), "w1": active(w1_active)}
    ctx = context(workers, residency=[("w1", "gpu", 1)], loads=loads)._replace(busy_share=0.0)
    scores = {r.worker_id: r.best_score for r in ctx.plan.routes}
    assert abs(scores["w0"] - scores["w1"]) < 0.05  # within the margin: a tie
    chosen = PredictedTTFT().choose(ctx)
    assert chosen is not None and chosen.worker_id == winner


@pytest.mark.parametrize(("w1_fixed_s", "winner"), [(1.2, "w1"), (1.4, "w0")])
def test_kvrelay_affinity_margin_grows_with_the_score(w1_fixed_s: float, winner: str) -> None:
    """Fitted speeds are noisy in proportion: on a calm cluster a route within a quarter of a 1 s best score is a
    tie that the cached tokens win (1.2 s), one further off is not (1.4 s)."""
    workers = [
        idle_heartbeat("w0", prefill_s_per_token=1e-4, decode_s_per_token=1.0),
        idle_heartbeat("w1", prefill_s_per_token=1e-4, decode_s_per_token=w1_fixed_s),
    ]
    ctx = context(workers, residency=[("w1", "gpu", 1)])._replace(busy_share=0.0)
    chosen = PredictedTTFT().choose(ctx)
    assert chosen is not None and chosen.worker_id == winner


@pytest.mark.parametrize(
    ("fast_prefill_s", "slow_prefill_s", "slow_fixed_s", "busy", "winner"),
    [
        (1e-4, 2.5e-4, 0.5, 0.5, "w1"),  # a slow class, within the margin on a busy cluster: the slow worker
        (1e-4, 2.5e-4, 0.9, 0.5, "w0"),  # beyond the margin: the lowest score
        (1e-4, 1.5e-4, 0.5, 0.5, "w0"),  # one class (1.5x apart): the lowest score
        (1e-4, 2.5e-4, 0.5, 0.0, "w0"),  # a calm cluster: the calm rule, which this does not touch
        (0.0, 2.5e-4, 0.45, 0.5, "w0"),  # a rate not measured yet: the lowest score
    ],
)
def test_kvrelay_spares_the_fast_workers_on_a_busy_mixed_fleet(
    fast_prefill_s: float, slow_prefill_s: float, slow_fixed_s: float, busy: float, winner: str
) -> None:
    """w0 prefills at ``fast_prefill_s`` a token with a fixed cost per request of 0.5 s, w1 at ``slow_prefill_s``
    with ``slow_fixed_s``; both idle and cold, so w0's score is the lowest. On a busy cluster w1 takes the request
    when it is of a slower class (2x or more) and its score is within a quarter of w0's."""
    workers = [
        idle_heartbeat("w0", prefill_s_per_token=fast_prefill_s, decode_s_per_token=0.5),
        idle_heartbeat("w1", prefill_s_per_token=slow_prefill_s, decode_s_per_token=slow_fixed_s),
    ]
    ctx = context(workers)._replace(busy_share=busy)
    scores = {r.worker_id: r.best_score for r in ctx.plan.routes}
    assert scores["w0"] < scores["w1"]
    chosen = PredictedTTFT().choose(ctx)
    assert chosen is not None and chosen.worker_id == winner


def test_kvrelay_caps_how_long_a_waiting_request_is_passed_under_a_long_backlog_and_peers_stay_fifo() -> None:
    from kvrelay.core.policies.kvrelay_ttft import DEADLINE_STRETCH, PASS_LIMIT_S

    kvrelay = make_policy("kvrelay")
    short, long = kvrelay.hold_order(100.0, 0.1), kvrelay.hold_order(100.0, 30.0)
    assert short.usual == short.long_backlog == 100.0 + DEADLINE_STRETCH * 0.1, "a short request's deadline stands"
    assert long.usual == 100.0 + DEADLINE_STRETCH * 30.0, "usually, the full deadline"
    assert long.long_backlog == 100.0 + PASS_LIMIT_S, "under a long backlog, passed for at most the limit"
    for name in ("round_robin", "mooncake", "llm_d", "sglang_cache_aware", "dynamo"):
        assert tuple(make_policy(name).hold_order(100.0, 30.0)) == (100.0, 100.0), name
