"""Queue priority under a backlog: kvrelay's deadline order against the peers' FIFO, in the simulator.

One worker. A 30,000-token prompt starts prefilling (3 s in 8,192-token chunks);
a 20,000-token prompt and then a 1,000-token prompt arrive behind it. kvrelay's
offers carry the deadline ``arrival + DEADLINE_STRETCH * predicted prefill``, so
the short prompt passes the waiting long one but not the started one; a peer
policy's offers carry 0 and its worker stays FIFO. These runs have no router
queue (``QUEUE_OFF``), so both wait at the worker; with it, both wait at the
router until the started prompt's first token and leave in the same deadline order.
"""

from __future__ import annotations

import pytest

from kvrelay.core.policies.kvrelay_ttft import DEADLINE_STRETCH
from kvrelay.core.router.queue import QUEUE_OFF, Limits
from kvrelay.core.router.state import RouterConfig
from kvrelay.sim.interpreter import Simulation
from tests.scenario.scenario_kit import (
    assert_invariants,
    offers_of,
    request,
    small_cluster,
    tokens,
)

PREFILL_S_PER_TOKEN = 1e-4


def run_backlog(policy: str, queue: Limits = QUEUE_OFF) -> Simulation:
    sim = Simulation(small_cluster(workers=1), policy=policy, seed=0, router_config=RouterConfig(queue=queue))
    sim.submit(request("started", tokens(1, 30_000), 2), at=1.0)
    sim.submit(request("long", tokens(2, 20_000), 2), at=1.01)
    sim.submit(request("short", tokens(3, 1_000), 2), at=1.02)
    assert sim.run(until=60.0)
    assert_invariants(sim)
    return sim


def first_token(sim: Simulation, rid: str) -> float:
    at = sim.consumers[rid].first_token_at
    assert at is not None
    return at


def test_kvrelay_lets_a_short_prompt_pass_a_waiting_long_one_but_not_a_started_one() -> None:
    sim = run_backlog("kvrelay")
    assert first_token(sim, "started") <= first_token(sim, "short") < first_token(sim, "long")
    [short], [long] = offers_of(sim, "short"), offers_of(sim, "long")
    # The router learns of a request one network hop (0.5 to 0.7 ms) after its submission.
    assert short.priority == pytest.approx(1.02 + DEADLINE_STRETCH * 1_000 * PREFILL_S_PER_TOKEN, abs=1e-3)
    assert long.priority == pytest.approx(1.01 + DEADLINE_STRETCH * 20_000 * PREFILL_S_PER_TOKEN, abs=1e-3)
    # Its first token comes with the started prompt's last chunk (5,424 tokens leave budget for it),
    # instead of after the long prompt's 2 s of prefill.
    assert first_token(sim, "short") - 1.02 < 3.3


def test_with_the_router_queue_the_short_prompt_still_leaves_before_the_long_one() -> None:
    sim = run_backlog("kvrelay", Limits(start_within_s=2.0))  # the started prompt alone is 3 s of work
    assert first_token(sim, "started") <= first_token(sim, "short") < first_token(sim, "long")
    assert sim.router.counters["queued"] == 2
    [short], [long] = offers_of(sim, "short"), offers_of(sim, "long")
    assert short.priority < long.priority


@pytest.mark.parametrize("policy", ["mooncake", "least_loaded"])
def test_a_peer_policy_sets_no_priority_and_its_worker_stays_fifo(policy: str) -> None:
    sim = run_backlog(policy)
    assert {o.priority for o in sim.offers} == {0.0}
    assert first_token(sim, "started") < first_token(sim, "long") <= first_token(sim, "short")
    assert first_token(sim, "short") - 1.02 > 4.9  # behind 5 s of prefill


def test_a_follower_relying_on_a_pending_prefix_does_not_pass_the_request_computing_it() -> None:
    """A started prompt keeps the worker busy; ``lead`` (a 20,000-token prefix) waits behind it, and ``follower``
    (the same prefix, a short tail) comes 10 ms later. Counting the prefix as pending (predict on route), its own
    deadline would put it before ``lead``, where it would find nothing to reuse and compute the prefix twice;
    its offer takes ``lead``'s priority instead, so it comes after ``lead`` and shares the prefix."""
    prefix = tokens(2, 20_000)
    sim = Simulation(small_cluster(workers=1), policy="kvrelay", seed=0, router_config=RouterConfig(queue=QUEUE_OFF))
    sim.submit(request("started", tokens(1, 30_000), 2), at=1.0)
    sim.submit(request("lead", prefix + tokens(3, 64), 2), at=1.01)
    sim.submit(request("follower", prefix + tokens(4, 64), 2), at=1.02)
    assert sim.run(until=60.0)
    assert_invariants(sim)
    [lead], [follower] = offers_of(sim, "lead"), offers_of(sim, "follower")
    assert follower.priority == lead.priority
    assert first_token(sim, "lead") <= first_token(sim, "follower")
    assert sim.workers["w0"].stats.rematched_chunks >= 20_000 // 64


def test_a_request_restoring_its_prefix_is_not_passed_by_a_prefill_that_started_meanwhile() -> None:
    """``probe``'s prefix is in the worker's ram; while it is restored, a 40,000-token prompt (4 s of prefill) is
    accepted after it and starts. As in the live runtime (``Job.place``), the probe, accepted first, goes before
    that prefill's next chunk once its restore is done, instead of waiting for all of it."""
    prefix = tokens(1, 20_000)
    sim = Simulation(small_cluster(workers=1), policy="kvrelay", seed=0, router_config=RouterConfig(queue=QUEUE_OFF))
    sim.submit(request("warm", prefix + tokens(2, 64), 2), at=0.5)
    sim.submit(request("filler", tokens(3, 62_000), 2), at=4.0)  # pushes most of the prefix out to ram
    sim.submit(request("probe", prefix + tokens(4, 64), 2), at=12.0)
    sim.submit(request("long", tokens(5, 40_000), 2), at=12.05)
    assert sim.run(until=60.0)
    assert_invariants(sim)
    probe = offers_of(sim, "probe")[-1]
    assert probe.route and probe.route[0].tier == "ram"
    # Behind the long prompt's first 8,192-token chunk (0.82 s) and its own 3,520-token rest, not its 4 s.
    assert first_token(sim, "probe") - 12.0 < 2.0
    assert first_token(sim, "probe") < first_token(sim, "long")
