"""Stale capacity: the router believes a prefix is resident, the worker evicted it, declines, and the
request still completes on a lower alternative.

w0 (256 pages of 16 tokens) holds the warm-up's 40-chunk prefix (160 pages). A
filler that needs 100 pages arrives first and evicts the prefix's oldest chunk;
the probe reaches the router before w0's residency "removed" event does, so it
is offered the gpu route on w0, which w0 re-checks and declines.
"""

from __future__ import annotations

from kvrelay.sim.interpreter import Simulation
from tests.scenario.scenario_kit import (
    assert_invariants,
    expected_stream,
    offers_of,
    request,
    small_cluster,
    tokens,
)

PREFIX = tokens(1, 2560)


def test_declined_stale_route_completes_on_a_lower_alternative() -> None:
    sim = Simulation(small_cluster(gpu_kv_tokens=4096), seed=5)
    sim.crash("w1", at=0.0, restart_after=3.0)
    sim.submit(request("warm", PREFIX + tokens(2, 10), 4), at=0.5)
    sim.submit(request("filler", tokens(3, 64), 1536), at=2.0)
    sim.submit(request("probe", PREFIX + tokens(4, 10), 4), at=2.0008)
    assert sim.run(until=300.0)
    assert_invariants(sim)
    first, second = offers_of(sim, "probe")
    assert (first.worker_id, first.route[0].tier, first.route[0].chunks) == ("w0", "gpu", 40)
    assert sim.router.counters["declined_stale_route"] == 1
    assert sim.workers["w0"].state.counters["declined_stale_route"] == 1
    assert all(seg.tier != "gpu" for seg in second.route) or second.worker_id != "w0"
    outcome = sim.consumers["probe"].outcomes[0]
    assert outcome.finish_reason == "length" and outcome.attempts == 2
    assert list(outcome.tokens) == expected_stream(sim, "probe", 4)
