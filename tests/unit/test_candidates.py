"""The predicted-TTFT scorer on hand-computed cases (docs/design.md section 6).

Every heartbeat here has kv_bytes_per_token = 1000 and chunk_tokens = 64, so a
chunk is 64,000 bytes; prefill costs 1 ms per token; a decode step 20 ms. The
prompt has 513 tokens: 8 cacheable chunks plus the last token.
"""

from __future__ import annotations

import pytest

from kvrelay.core.planning import candidates as cand
from kvrelay.core.planning import exclusions, predicted_ttft
from kvrelay.core.planning.exclusions import ExclusionKind
from kvrelay.core.planning.index import ResidencyIndex
from kvrelay.core.planning.roster import Roster, plan_pruned
from kvrelay.protocol.chunk_keys import prompt_chain
from kvrelay.protocol.messages import Heartbeat
from tests.support.router_driver import Driver, offers
from tests.support.router_driver import heartbeat as idle_heartbeat

PROMPT = tuple(range(1, 64 * 8 + 2))
CHAIN = prompt_chain(b"m", PROMPT, 64)
RECOMPUTE_ALL = 513 * 1e-3 + 0.02


def heartbeat(worker_id: str, **overrides: object) -> Heartbeat:
    """A worker that is decoding (one 20 ms decode step per prefill iteration, prompts in one iteration)."""
    return idle_heartbeat(worker_id, **{"active_lanes": 1, **overrides})


def plan_for(workers: list, residency: list[tuple[str, str, int]]) -> cand.Plan:
    index = ResidencyIndex()
    for wid, tier, n in residency:
        index.store(wid, tier, CHAIN[:n])
    views = [
        predicted_ttft.WorkerView(
            hb,
            predicted_ttft.WorkerLoad(restore_backlog_s=hb.lower_tier_load_s),
            predicted_ttft.reported_fingerprints(hb),
        )
        for hb in workers
    ]
    return cand.plan("m", len(PROMPT), 4, CHAIN, b"m", 64, views, index)


def test_recompute_everything_is_scored_exactly() -> None:
    plan = plan_for([heartbeat("w0")], [])
    best = plan.best()
    assert best is not None and best.route == () and best.cached_tokens == 0
    assert best.predicted_ttft_s == pytest.approx(RECOMPUTE_ALL)
    assert best.terms.prefill_s == pytest.approx(0.513) and best.terms.queue_s == 0.0


def test_ssd_prefix_slower_to_restore_than_to_recompute_loses() -> None:
    # 64,000 B / 500,000 B/s = 128 ms per chunk from ssd, 64 ms to recompute it.
    slow_ssd = heartbeat("w0", restore_bytes_per_s={"ssd": 5e5})
    plan = plan_for([slow_ssd], [("w0", "ssd", 8)])
    (route,) = plan.routes
    assert [s.tier for s in route.segments] == ["ssd"] and route.segments[0].chunks == 8
    assert route.best.route == ()
    view = predicted_ttft.WorkerView(
        slow_ssd, predicted_ttft.WorkerLoad(), predicted_ttft.reported_fingerprints(slow_ssd)
    )
    alternatives = cand.alternatives(route, view, len(PROMPT), 4, 0.0)
    assert [c.cached_tokens for c in alternatives] == [0, 512]
    ssd = alternatives[1]
    assert ssd.predicted_ttft_s == pytest.approx(8 * 0.128 + 1e-3 + 0.02)
    assert route.best.predicted_ttft_s < ssd.predicted_ttft_s


def test_ssd_prefix_faster_than_recompute_wins() -> None:
    plan = plan_for([heartbeat("w0")], [("w0", "ssd", 8)])  # 2.5e8 B/s: 0.256 ms per chunk
    best = plan.best()
    assert best is not None and [(s.tier, s.chunks) for s in best.route] == [("ssd", 8)]
    assert best.predicted_ttft_s == pytest.approx(8 * 64000 / 2.5e8 + 1e-3 + 0.02)
    assert best.terms.restore_s == {"ssd": pytest.approx(8 * 64000 / 2.5e8)}


def test_warm_worker_with_a_long_queue_loses_to_a_cold_idle_one() -> None:
    plan = plan_for([heartbeat("w0", queue_delay_s=1.0), heartbeat("w1")], [("w0", "gpu", 8)])
    best = plan.best()
    assert best is not None and best.worker_id == "w1" and best.cached_tokens == 0
    assert best.predicted_ttft_s == pytest.approx(RECOMPUTE_ALL)


def test_warm_worker_with_a_short_queue_wins() -> None:
    plan = plan_for([heartbeat("w0", queue_delay_s=0.3), heartbeat("w1")], [("w0", "gpu", 8)])
    best = plan.best()
    assert best is not None and best.worker_id == "w0" and best.cached_tokens == 512
    assert best.predicted_ttft_s == pytest.approx(0.3 + 1e-3 + 0.02)


def test_a_lower_tier_on_an_idle_worker_beats_a_gpu_prefix_behind_a_queue() -> None:
    plan = plan_for([heartbeat("w0", queue_delay_s=2.0), heartbeat("w1")], [("w0", "gpu", 8), ("w1", "ram", 8)])
    best = plan.best()
    assert best is not None and best.worker_id == "w1"
    assert [(s.tier, s.chunks) for s in best.route] == [("ram", 8)]


def test_peer_and_object_tiers_extend_a_local_prefix() -> None:
    # w0 holds 3 chunks in gpu; w1 holds 6 in ram (servable to w0 as a peer); the object tier holds all 8.
    plan = plan_for(
        [heartbeat("w0"), heartbeat("w1", queue_delay_s=9.0)], [("w0", "gpu", 3), ("w1", "ram", 6), ("w1", "object", 8)]
    )
    route = next(r for r in plan.routes if r.worker_id == "w0")
    assert [(s.tier, s.chunks, s.source) for s in route.segments] == [
        ("gpu", 3, ""),
        ("peer", 3, "w1"),
        ("object", 2, ""),
    ]
    assert route.best.cached_tokens == 512


def test_hard_constraints_say_why_a_worker_was_removed() -> None:
    plan = plan_for(
        [
            heartbeat("small", pages_free=2, pages_total=2),
            heartbeat("short", context_limit=100),
            heartbeat("other", models=("x",)),
            heartbeat("ok"),
        ],
        [],
    )
    assert exclusions.texts(plan.excluded) == {
        "small": "capacity",
        "short": "context limit 100 < 517",
        "other": "model 'm' not served",
    }
    assert {w: e.kind for w, e in plan.excluded.items()} == {
        "small": ExclusionKind.CAPACITY,
        "short": ExclusionKind.CONTEXT_LIMIT,
        "other": ExclusionKind.MODEL_NOT_SERVED,
    }
    assert [r.worker_id for r in plan.routes] == ["ok"]


def test_page_demand_counts_a_copy_on_write_page_for_a_partial_shared_page() -> None:
    assert predicted_ttft.page_demand(100, 28, 0, 16) == 8
    assert predicted_ttft.page_demand(100, 28, 64, 16) == 4
    assert predicted_ttft.page_demand(100, 28, 40, 16) == 8 - 2 + 1


def test_ties_break_by_worker_id() -> None:
    plan = plan_for([heartbeat("w1"), heartbeat("w0")], [])
    best = plan.best()
    assert best is not None and best.worker_id == "w0"


@pytest.mark.parametrize(("queue", "winner"), [(2.0, "w1"), (0.3, "w0")])
def test_router_follows_the_score_on_locality_against_load(queue: float, winner: str) -> None:
    # Half the workers are busy, so prefill seconds weigh 1 + 2 * 0.5 = 2 (policies.kvrelay_ttft):
    # w0 scores queue + 2 * 1 ms + 20 ms, cold w1 scores 2 * 513 ms + 20 ms = 1.046 s.
    d = Driver()
    d.message(heartbeat("w0", queue_delay_s=queue))
    d.message(heartbeat("w1"))
    d.residency("w0", "gpu", CHAIN)
    (offer,) = offers(d.request("r", PROMPT))
    assert offer.worker_id == winner


def test_a_restore_adds_to_the_queue_and_waits_for_the_restore_channel() -> None:
    # Queue 0.5 s; 8 ssd chunks take 8 * 64,000 / 5e5 = 1.024 s, added to the queue (not hidden behind it).
    hb = heartbeat("w0", queue_delay_s=0.5, restore_bytes_per_s={"ssd": 5e5})
    best = plan_for([hb], [("w0", "ssd", 8)]).best()
    assert best is not None and best.cached_tokens == 0
    assert best.predicted_ttft_s == pytest.approx(0.5 + 0.513 + 0.02)
    # With a restore channel busy for 0.8 s the queue term is 0.8 s.
    fast = heartbeat("w0", queue_delay_s=0.5, lower_tier_load_s=0.8, restore_bytes_per_s={"ssd": 1e9})
    plan = plan_for([fast], [("w0", "ssd", 8)])
    view = predicted_ttft.WorkerView(fast, predicted_ttft.WorkerLoad(restore_backlog_s=0.8), {})
    ssd = cand.alternatives(plan.routes[0], view, len(PROMPT), 4, 0.0)
    restored = next(c for c in ssd if c.cached_tokens == 512)
    assert restored.terms.queue_s == pytest.approx(0.8)
    assert restored.predicted_ttft_s == pytest.approx(0.8 + 8 * 64000 / 1e9 + 1e-3 + 0.02)
    assert restored.terms.total_s == pytest.approx(restored.predicted_ttft_s)


def test_pruning_skips_hopeless_workers_and_keeps_the_same_winner() -> None:
    workers = [heartbeat(f"w{i}", queue_delay_s=0.1 * i) for i in range(8)]
    residency = [("w3", "gpu", 8)]
    full = plan_for(workers, residency)
    index = ResidencyIndex()
    for wid, tier, n in residency:
        index.store(wid, tier, CHAIN[:n])
    roster = Roster()
    for hb in workers:
        roster.put(predicted_ttft.WorkerView(hb, predicted_ttft.WorkerLoad(), predicted_ttft.reported_fingerprints(hb)))
    pruned = plan_pruned("m", len(PROMPT), 4, CHAIN, b"m", 64, roster, index)
    assert pruned.best() == full.best()
    assert pruned.best().worker_id == "w3"  # type: ignore[union-attr]
    # w3 (bound 0.301 s) is planned first; everyone else's bound (a queue of 0.4 s and more, or
    # recomputing all 513 tokens: 0.513 s and more) exceeds its 0.321 s.
    assert [r.worker_id for r in pruned.routes] == ["w3"]
    assert set(pruned.pruned) == {f"w{i}" for i in range(8)} - {"w3"}
    assert all(bound >= pruned.best().predicted_ttft_s for bound in pruned.pruned.values())  # type: ignore[union-attr]


def test_released_estimates_leave_exactly_zero_outstanding() -> None:
    load = predicted_ttft.WorkerLoad()
    for estimate in (0.1, 0.2, 0.3):
        load.outstanding_s += estimate
    for estimate in (0.1, 0.2, 0.3):
        load.release_outstanding(estimate)
    assert load.outstanding_s == 0.0  # plain float subtraction leaves 5.6e-17, which breaks ties by residue
    load.outstanding_s = 1.0
    load.release_outstanding(0.25)
    assert load.outstanding_s == 0.75


def test_work_weight_prefers_the_start_that_leaves_device_time_to_others() -> None:
    # w0 holds all 8 chunks on gpu behind a 0.52 s queue: 0.52 + 1 ms + 20 ms = 0.541 s, 1 token of work.
    # w1 is idle and cold: 513 ms + 20 ms = 0.533 s, all 513 tokens of work.
    workers = [heartbeat("w0", queue_delay_s=0.52), heartbeat("w1")]
    index = ResidencyIndex()
    index.store("w0", "gpu", CHAIN)
    views = [
        predicted_ttft.WorkerView(hb, predicted_ttft.WorkerLoad(), predicted_ttft.reported_fingerprints(hb))
        for hb in workers
    ]
    by_ttft = cand.plan("m", len(PROMPT), 4, CHAIN, b"m", 64, views, index).best()
    assert by_ttft is not None and by_ttft.worker_id == "w1"
    assert by_ttft.predicted_ttft_s == pytest.approx(0.533)
    weighted = cand.plan(
        "m", len(PROMPT), 4, CHAIN, b"m", 64, views, index, scoring=predicted_ttft.Scoring(work_weight=0.5)
    ).best()
    assert weighted is not None and weighted.worker_id == "w0" and weighted.cached_tokens == 512
    assert weighted.predicted_ttft_s == pytest.approx(0.541)
    assert weighted.score_s == pytest.approx(0.541 + 0.5 * 1e-3)


def test_work_is_priced_at_the_fleet_rate_so_a_slow_idle_worker_is_not_charged_its_slowness_twice() -> None:
    # w0 is slow (2.5 ms per token) and idle: 513 * 2.5 ms + 20 ms = 1.3025 s to the first token.
    # w1 is fast (1 ms per token) behind a 0.9 s queue: 0.9 + 0.513 + 0.02 = 1.433 s.
    # Priced at each worker's own rate, a work weight of 1 adds 1.2825 s to w0 and 0.513 s to w1, and the later
    # start wins; at the fleet's rate (2 / (400 + 1000 tokens/s)) both add the same, and the earlier start wins.
    workers = [idle_heartbeat("w0", prefill_s_per_token=2.5e-3), idle_heartbeat("w1", queue_delay_s=0.9)]
    views = [
        predicted_ttft.WorkerView(hb, predicted_ttft.WorkerLoad(), predicted_ttft.reported_fingerprints(hb))
        for hb in workers
    ]
    roster = Roster()
    for v in views:
        roster.put(v)
    price = roster.work_s_per_token()
    assert price == pytest.approx(2 / 1400)

    def best(scoring: predicted_ttft.Scoring) -> predicted_ttft.Candidate:
        c = cand.plan("m", len(PROMPT), 4, CHAIN, b"m", 64, views, ResidencyIndex(), scoring=scoring).best()
        assert c is not None
        pruned = plan_pruned("m", len(PROMPT), 4, CHAIN, b"m", 64, roster, ResidencyIndex(), scoring=scoring).best()
        assert pruned == c
        return c

    own_rate = best(predicted_ttft.Scoring(work_weight=1.0))
    assert own_rate.worker_id == "w1" and own_rate.score_s == pytest.approx(1.433 + 0.513)
    fleet_rate = best(predicted_ttft.Scoring(work_weight=1.0, work_s_per_token=price))
    assert fleet_rate.worker_id == "w0"
    assert fleet_rate.predicted_ttft_s == pytest.approx(1.3025)
    assert fleet_rate.score_s == pytest.approx(1.3025 + 513 * price)


def test_router_prices_work_at_the_fleet_rate() -> None:
    # The same two workers behind kvrelay's policy: one of two is busy, so the work weight is 2 * 0.5 = 1.
    d = Driver()
    d.message(idle_heartbeat("w0", prefill_s_per_token=2.5e-3))
    d.message(idle_heartbeat("w1", queue_delay_s=0.9))
    (offer,) = offers(d.request("r", PROMPT))
    assert offer.worker_id == "w0"


def test_counted_interleave_sends_a_long_prefill_to_the_idle_worker_without_lanes() -> None:
    # Chunks of 128 tokens: 513 uncached tokens take 5 iterations, so w0 (1 lane, empty queue) runs 4 decode
    # steps between them: 0.513 + 4 * 0.02 + 0.02 = 0.613 s. w1 has no lanes: 0.533 s. w2 has lanes but a
    # queue of 10 ms, so the lanes its prefill will meet are unknown and not counted: 0.543 s.
    workers = [
        heartbeat("w0", prefill_chunk_tokens=128),
        idle_heartbeat("w1", prefill_chunk_tokens=128),
        heartbeat("w2", prefill_chunk_tokens=128, queue_delay_s=0.01),
    ]
    views = [
        predicted_ttft.WorkerView(hb, predicted_ttft.WorkerLoad(), predicted_ttft.reported_fingerprints(hb))
        for hb in workers
    ]
    plan = cand.plan(
        "m", len(PROMPT), 4, CHAIN, b"m", 64, views, ResidencyIndex(), scoring=predicted_ttft.Scoring(interleave=True)
    )
    by_worker = {r.worker_id: r.best for r in plan.routes}
    assert by_worker["w0"].predicted_ttft_s == pytest.approx(0.613)
    assert by_worker["w0"].terms.decode_s == pytest.approx(0.1)
    assert by_worker["w1"].predicted_ttft_s == pytest.approx(0.533)
    assert by_worker["w2"].predicted_ttft_s == pytest.approx(0.543)
    assert plan.best() == by_worker["w1"]
    uncounted = cand.plan("m", len(PROMPT), 4, CHAIN, b"m", 64, views, ResidencyIndex()).best()
    assert uncounted is not None and uncounted.worker_id == "w0"  # a tie with w1, to the lower id


def test_alternative_routes_stand_for_the_alternatives_also_after_the_load_changed() -> None:
    # w0: gpu 3 + peer 3 + object 2 (four boundaries, all feasible); the lazy routes expand to the same candidates.
    workers = [heartbeat("w0"), heartbeat("w1", queue_delay_s=9.0)]
    index = ResidencyIndex()
    for wid, tier, n in [("w0", "gpu", 3), ("w1", "ram", 6), ("w1", "object", 8)]:
        index.store(wid, tier, CHAIN[:n])
    views = {
        hb.worker_id: predicted_ttft.WorkerView(
            hb, predicted_ttft.WorkerLoad(), predicted_ttft.reported_fingerprints(hb)
        )
        for hb in workers
    }
    plan = cand.plan("m", len(PROMPT), 4, CHAIN, b"m", 64, list(views.values()), index)
    route = next(r for r in plan.routes if r.worker_id == "w0")
    view = views["w0"]
    eager = cand.alternatives(route, view, len(PROMPT), 4, 0.0)
    lazy = cand.alternative_routes(route, view, len(PROMPT), 4, 0.0)
    assert len(eager) == 4 and [r.best for r in lazy] == eager
    assert lazy[0].best == route.best and [r.predicted_ttft_s for r in lazy] == [c.predicted_ttft_s for c in eager]
    view.load.unheard_s = 0.25  # the router sent more since the last heartbeat: the alternatives are re-scored
    # 517 tokens need 33 pages of 16; sharing the 192-token gpu prefix, 21: with 25 left, recomputing does not fit
    assert view.heartbeat.page_tokens == 16
    view.load.inflight_pages = view.heartbeat.pages_free + view.heartbeat.pages_evictable - 25
    eager = cand.alternatives(route, view, len(PROMPT), 4, 0.0)
    lazy = cand.alternative_routes(route, view, len(PROMPT), 4, 0.0)
    assert [r.best for r in lazy] == eager and all(c.terms.queue_s == 0.25 for c in eager)
    assert sorted(c.cached_tokens for c in eager) == [192, 384, 512]
