"""Predict on route, in the simulator: followers that arrive during a long prefill reuse it.

Two workers. A 40,000-token prompt starts prefilling at t = 1 s (4 s of prefill);
four followers share its first 624 chunks and arrive during that prefill. With
predict on route the router credits the leader's worker with its chunks, so the
followers go there, and that worker re-matches their prefix when their prefill
starts, after the leader's: each computes only its own 264 tokens. Without it,
no copy of the prefix exists anywhere when they arrive, and each recomputes all
40,000 tokens on whichever worker is least queued. The router queue is off
(``QUEUE_OFF``) in both runs: it would hold the followers at the router until
the leader's prefill ends, and so reuse its prefix without any prediction.
"""

from __future__ import annotations

from kvrelay.core.policies import make_policy
from kvrelay.core.router.queue import QUEUE_OFF
from kvrelay.core.router.state import RouterConfig
from kvrelay.sim.interpreter import Simulation
from tests.scenario.scenario_kit import assert_invariants, request, small_cluster, tokens

LEADER = tokens(1, 40_000)
FOLLOWERS = [LEADER[: 624 * 64] + tokens(10 + i, 264) for i in range(4)]


def run(predict: bool, rematch: bool) -> Simulation:
    policy = make_policy("kvrelay")
    policy.predicts_on_route = predict
    cluster = small_cluster(workers=2, gpu_kv_tokens=400_000)
    config = RouterConfig(queue=QUEUE_OFF)
    sim = Simulation(cluster, policy=policy, seed=0, rematch=rematch, router_config=config)
    sim.submit(request("leader", LEADER, 4), at=1.0)
    for i, prompt in enumerate(FOLLOWERS):
        sim.submit(request(f"f{i}", prompt, 4), at=1.5 + 0.2 * i)
    assert sim.run(until=120.0)
    assert_invariants(sim)
    return sim


def ttft(sim: Simulation, rid: str) -> float:
    c = sim.consumers[rid]
    assert c.first_token_at is not None
    return c.first_token_at - c.submitted_at


def recomputed(sim: Simulation, rid: str) -> int:
    return sim.consumers[rid].outcomes[0].usage.recomputed_tokens


def worker_of(sim: Simulation, rid: str) -> str:
    return [o.worker_id for o in sim.offers if o.assignment.request_id == rid][-1]


def test_followers_reuse_the_prefix_their_leader_is_computing() -> None:
    on, off = run(predict=True, rematch=True), run(predict=False, rematch=False)
    followers = [f"f{i}" for i in range(4)]
    assert {worker_of(on, f) for f in followers} == {worker_of(on, "leader")}
    assert all(recomputed(on, f) == 264 for f in followers)
    assert all(recomputed(off, f) == 40_200 for f in followers)
    assert all(on.consumers[f].outcomes[0].usage.cached_tokens == {"gpu": 624 * 64} for f in followers)
    # Each follower starts after the leader's 4 s of prefill and adds 26 ms of its own.
    assert max(ttft(on, f) for f in followers) < 4.2
    assert sum(ttft(on, f) for f in followers) < 0.5 * sum(ttft(off, f) for f in followers)
    waited = sum(w.stats.deferred for w in on.workers.values())
    assert waited > 0 and sum(w.stats.rematched_chunks for w in on.workers.values()) == 4 * 624


def test_predicting_without_rematching_at_prefill_start_only_queues_the_followers() -> None:
    """The router's credit alone is not enough: a worker that matches only at admission recomputes."""
    sim = run(predict=True, rematch=False)
    assert all(recomputed(sim, f"f{i}") == 40_200 for i in range(4))
