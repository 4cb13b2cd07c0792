"""Locality against load: a warm worker wins only while its queue costs less than the cold prefill.

w1 is down until t=2.7, so the warm-up and the fillers all land on w0. The
probe shares a 19,200-token prefix with the warm-up: cold, it costs ~1.92 s of
prefill; warm on w0, it costs w0's queue plus a 64-token tail. The router queue
is off (``QUEUE_OFF``), so the fillers queue on w0 rather than at the router:
what is weighed here is a worker queue against a cold prefill.
"""

from __future__ import annotations

import pytest

from kvrelay.core.router.queue import QUEUE_OFF
from kvrelay.core.router.state import RouterConfig
from kvrelay.sim.interpreter import Simulation
from tests.scenario.scenario_kit import (
    assert_invariants,
    offers_of,
    request,
    small_cluster,
    tokens,
)

PREFIX = tokens(1, 19_200)
COLD_PREFILL_S = 19_264 * 1e-4


def run_probe(fillers: int) -> Simulation:
    sim = Simulation(small_cluster(gpu_kv_tokens=200_000), seed=3, router_config=RouterConfig(queue=QUEUE_OFF))
    sim.crash("w1", at=0.0, restart_after=2.7)
    sim.submit(request("warm", PREFIX + tokens(2, 64), 4), at=0.5)
    for i in range(fillers):
        sim.submit(request(f"fill{i}", tokens(100 + i, 8192), 4), at=2.6)
    sim.submit(request("probe", PREFIX + tokens(3, 64), 4), at=3.2)
    assert sim.run(until=120.0)
    assert_invariants(sim)
    return sim


def test_warm_but_overloaded_worker_loses_to_a_cold_idle_one() -> None:
    sim = run_probe(fillers=6)  # ~4.9 s of queued prefill on w0
    [offer] = offers_of(sim, "probe")
    assert offer.worker_id == "w1"
    assert all(seg.tier != "gpu" for seg in offer.route)
    c = sim.consumers["probe"]
    ttft = c.first_token_at - c.submitted_at
    # Cold prefill beat waiting behind w0's queue (which still held > 4 s of work).
    assert COLD_PREFILL_S <= ttft < COLD_PREFILL_S + 0.2
    assert c.outcomes[0].usage.cached_tokens.get("gpu", 0) == 0


def test_warm_worker_wins_when_its_queue_is_short() -> None:
    sim = run_probe(fillers=1)  # ~0.8 s of queued prefill on w0
    [offer] = offers_of(sim, "probe")
    assert offer.worker_id == "w0"
    assert offer.route[0].tier == "gpu" and offer.route[0].chunks == 300
    c = sim.consumers["probe"]
    assert c.first_token_at - c.submitted_at < COLD_PREFILL_S
    assert c.outcomes[0].usage.cached_tokens["gpu"] == 19_200


@pytest.mark.parametrize("fillers", [1, 6])
def test_the_fillers_ran_on_the_warm_worker(fillers: int) -> None:
    sim = run_probe(fillers)
    assert {o.worker_id for o in sim.offers if o.assignment.request_id.startswith("fill")} == {"w0"}
