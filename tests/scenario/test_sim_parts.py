"""The simulator's parts on their own: network model, caches, admission, costs and the config."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvrelay.protocol.messages import Assignment, Offer, RouteSegment
from kvrelay.sim.admission import (
    AdmissionDecline,
    AdmissionPlan,
    plan_admission,
)
from kvrelay.sim.cache import SharedObjectTier, WorkerCaches
from kvrelay.sim.cluster_config import (
    ClusterConfigError,
    NetworkSpec,
    load_cluster_config,
)
from kvrelay.sim.interpreter import Simulation
from kvrelay.sim.network import NetworkModel
from kvrelay.sim.tokens import token_value
from tests.scenario.scenario_kit import (
    assert_invariants,
    request,
    small_cluster,
    tokens,
)

KEYS = [bytes([i]) * 16 for i in range(40)]


def test_network_is_seeded_fifo_directed_and_heals() -> None:
    def fates(seed: int) -> list[float | None]:
        net = NetworkModel(NetworkSpec(delay_s=0.01, jitter_s=0.05, loss=0.2), seed)
        return [net.transit("router", "w0", i * 0.001) for i in range(200)]

    a = fates(1)
    assert a == fates(1) and a != fates(2)
    lost = sum(1 for t in a if t is None)
    assert 20 < lost < 60
    arrivals = [t for t in a if t is not None]
    assert arrivals == sorted(arrivals)  # one link is FIFO even with jitter larger than the send gap
    net = NetworkModel(NetworkSpec(delay_s=0.01, jitter_s=0.0, loss=0.0), 0)
    net.partition("w0", "router", start=1.0, end=2.0)
    assert net.transit("w0", "router", 1.5) is None
    assert net.transit("router", "w0", 1.5) == pytest.approx(1.51)  # the other direction works
    assert net.transit("w0", "router", 2.0) == pytest.approx(2.01)  # healed
    with pytest.raises(ValueError, match="must end after it starts"):
        net.partition("w0", "router", start=3.0, end=3.0)


def caches(gpu_pages: int = 16) -> WorkerCaches:
    return WorkerCaches(
        gpu_pages, chunk_pages=4, ram_chunks=2, ssd_chunks=2, shared=SharedObjectTier(), object_write_through=True
    )


def test_gpu_evictions_demote_to_ram_then_ssd_and_pins_protect() -> None:
    c = caches()
    c.reserve(16)
    for k in KEYS[:4]:
        assert c.add_to_gpu(k, computed=True)
    assert c.gpu.reserved == 0 and c.gpu.free_pages == 0
    for k in KEYS[:4]:
        c.gpu.unpin(k)
    c.gpu.pin(KEYS[0])  # protected, and now the most recently used
    c.drain_changes()
    c.reserve(12)  # needs three chunks' pages: evicts 1, 2, 3 (least recently used, unpinned)
    assert list(c.gpu.cache) == [KEYS[0]]
    changes = c.drain_changes()
    assert changes["gpu"] == {KEYS[1]: False, KEYS[2]: False, KEYS[3]: False}
    assert list(c.ram.entries) == [KEYS[2], KEYS[3]] and list(c.ssd.entries) == [KEYS[1]]
    assert changes["ram"] == {KEYS[1]: False, KEYS[2]: True, KEYS[3]: True}
    assert changes["ssd"] == {KEYS[1]: True}
    assert c.restore_sources(KEYS[1]) == ("ssd", "object")


def offer(route: tuple[RouteSegment, ...], prompt_len: int = 64 * 3 + 5, max_new: int = 11) -> Offer:
    return Offer(
        assignment=Assignment("r", 1),
        worker_id="w0",
        epoch=1,
        model="m",
        prompt=tuple(range(prompt_len)),
        max_new_tokens=max_new,
        route=route,
        chain=tuple(KEYS[: sum(s.chunks for s in route)]),
    )


def test_admission_rechecks_the_route_against_the_caches() -> None:
    cluster = small_cluster()
    c = caches(gpu_pages=64)
    c.reserve(8)
    c.add_to_gpu(KEYS[0], computed=True)
    c.add_to_gpu(KEYS[1], computed=False)
    c.gpu.unpin(KEYS[0])
    c.gpu.unpin(KEYS[1])
    c.ram.insert(KEYS[2])
    chain = tuple(KEYS[:3])
    plan = plan_admission(offer((RouteSegment("gpu", 2), RouteSegment("ram", 1))), chain, c, {}, cluster)
    assert isinstance(plan, AdmissionPlan)
    assert plan.gpu_keys == (KEYS[0], KEYS[1]) and plan.restore == ((KEYS[2], "ram"),)
    assert plan.cached_tokens == {"gpu": 128, "ram": 64} and plan.uncached_tokens == 5
    assert plan.demand_pages == math.ceil((197 + 11) / 16) - 8
    assert plan.restore_s == pytest.approx(64 * cluster.kv_bytes_per_token / 20e9)
    # Automatic prefix caching: a recompute route still shares what is resident.
    auto = plan_admission(offer((RouteSegment("recompute", 3),)), chain, c, {}, cluster)
    assert isinstance(auto, AdmissionPlan) and auto.gpu_keys == (KEYS[0], KEYS[1]) and auto.restore == ()
    stale = plan_admission(offer((RouteSegment("gpu", 3),)), chain, c, {}, cluster)
    assert stale == AdmissionDecline("stale_route", "gpu prefix chunk 2 is no longer resident")
    slower = plan_admission(offer((RouteSegment("gpu", 2), RouteSegment("ssd", 1))), chain, c, {}, cluster)
    assert isinstance(slower, AdmissionPlan) and slower.restore == ((KEYS[2], "ram"),)  # faster tier used
    big = plan_admission(offer((RouteSegment("gpu", 2),), max_new=2000), chain, c, {}, cluster)
    assert isinstance(big, AdmissionDecline) and big.reason == "no_capacity"


def test_peer_restore_reads_another_workers_ram() -> None:
    cluster = small_cluster()
    mine, theirs = caches(64), caches(64)
    theirs.ram.insert(KEYS[0])
    plan = plan_admission(offer((RouteSegment("peer", 1, "w1"),)), (KEYS[0],), mine, {"w1": theirs}, cluster)
    assert isinstance(plan, AdmissionPlan) and plan.restore == ((KEYS[0], "peer"),)
    gone = plan_admission(offer((RouteSegment("peer", 1, "w1"),)), (KEYS[0],), mine, {"w1": caches(64)}, cluster)
    assert isinstance(gone, AdmissionDecline) and gone.reason == "stale_route"


def test_token_values_depend_only_on_seed_and_position() -> None:
    assert token_value(7, 100) == token_value(7, 100)
    assert len({token_value(7, p) for p in range(100)}) > 90
    assert token_value(7, 100) != token_value(8, 100)


def test_chunked_prefill_and_decode_steps_take_their_declared_time() -> None:
    sim = Simulation(small_cluster(workers=1), seed=0)
    sim.submit(request("a", tokens(1, 10_000), 3), at=1.0)
    assert sim.run(until=60.0)
    assert_invariants(sim)
    c = sim.consumers["a"]
    ttft = c.first_token_at - c.submitted_at
    # Two iterations (8192 + 1808 tokens at 0.1 ms each), plus network and the accept round trip.
    assert 1.0 <= ttft < 1.0 + 0.005
    assert sim.now - c.first_token_at == pytest.approx(2 * 0.025, abs=0.002)


def test_default_config_figures_and_errors(tmp_path: Path) -> None:
    c = load_cluster_config()
    figures = (c.workers, c.kv_bytes_per_token, c.worker.gpu_kv_tokens, c.worker.decode_step_s)
    assert figures == (8, 131072, 400_000, 0.025)
    assert c.worker.restore_bytes_per_s == {"ram": 20e9, "ssd": 5e9, "peer": 10e9, "object": 2e9}
    bad = tmp_path / "bad.toml"
    bad.write_text("workers = 2\n[worker]\ngpu_tokens = 5\n")
    with pytest.raises(ClusterConfigError, match=r"bad.toml.worker: unknown key\(s\) gpu_tokens; allowed: gpu_kv"):
        load_cluster_config(bad)
    bad.write_text("chunk_tokens = 60\n")
    with pytest.raises(ClusterConfigError, match="multiple of page_tokens"):
        load_cluster_config(bad)
    with pytest.raises(ClusterConfigError, match="does not exist"):
        load_cluster_config(tmp_path / "none.toml")


CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_a_vllm_fleet_restores_only_from_its_own_host_ram() -> None:
    """No shared tier, no peers, no disk: a prefix computed on one worker is never restored on another."""
    from kvrelay.sim.replay import ReplayOptions, replay
    from kvrelay.sim.trace import TraceRequest

    fleet = load_cluster_config(CONFIGS / "cluster-vllm-fleet.toml")
    assert fleet.tiers == ("ram",) and fleet.rates_of(fleet.worker) == {"ram": 20e9}
    sim = Simulation(fleet, seed=0)
    assert [set(w.heartbeat(0.0).restore_bytes_per_s) for w in sim.workers.values()] == [{"ram"}] * 8
    trace = [TraceRequest(i + 1, 300.0 * i, 4000, 4, (1, 2, 3, 4, 5, 6, 7, 100 + i)) for i in range(16)]
    m = replay(trace, fleet, "round_robin", ReplayOptions(block_tokens=512))
    assert m["completed"] == 16 and set(m["cached_tokens_by_tier"]) <= {"gpu", "ram"}
    assert m["bytes_restored_by_tier"].keys() <= {"ram"}


def test_worker_groups_give_workers_their_own_specs(tmp_path: Path) -> None:
    mixed = load_cluster_config(CONFIGS / "cluster-heterogeneous.toml")
    slow, fast = mixed.spec_of(0), mixed.spec_of(7)
    assert [mixed.spec_of(i).prefill_s_per_token for i in range(8)] == [2.5e-4] * 4 + [1e-4] * 4
    assert slow.restore_bytes_per_s == {"ram": 12e9, "ssd": 5e9, "peer": 10e9, "object": 2e9}
    assert slow.gpu_kv_tokens == fast.gpu_kv_tokens and slow.decode_step_s == 0.04
    sim = Simulation(mixed, seed=0)
    assert sim.workers["w0"].heartbeat(0.0).prefill_s_per_token == 2.5e-4
    assert sim.workers["w4"].heartbeat(0.0).prefill_s_per_token == 1e-4
    bad = tmp_path / "bad.toml"
    bad.write_text("workers = 2\n[[worker_group]]\ncount = 3\n")
    with pytest.raises(ClusterConfigError, match="add up to more than workers"):
        load_cluster_config(bad)
    bad.write_text('tiers = ["ram", "tape"]\n')
    with pytest.raises(ClusterConfigError, match=r"unknown tier\(s\) \['tape'\]"):
        load_cluster_config(bad)
