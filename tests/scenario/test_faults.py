"""Faults: a directed partition, a worker crash mid-decode, and the offer-timeout fallback."""

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

PREFIX = tokens(1, 1280)


def warm_sim(seed: int, w1_back_at: float) -> Simulation:
    """w0 alone until ``w1_back_at``; a warm-up makes w0 the prefix holder."""
    sim = Simulation(small_cluster(), seed=seed)
    sim.crash("w1", at=0.0, restart_after=w1_back_at)
    sim.submit(request("warm", PREFIX + tokens(2, 10), 2), at=0.5)
    return sim


def test_directed_partition_reroutes_and_the_late_result_completes_nothing() -> None:
    sim = warm_sim(seed=7, w1_back_at=1.5)
    # w0 -> router is cut from t=2.0 (the acceptance and every delta are lost) until 4.5;
    # router -> w0 is cut only after the offer arrived, so the timeout's cancel is lost too.
    sim.partition("w0", "router", start=2.0, end=4.5)
    sim.partition("router", "w0", start=2.01, end=4.5)
    sim.submit(request("p", PREFIX + tokens(3, 10), 200), at=2.0)
    assert sim.run(until=300.0)
    assert_invariants(sim)
    first, second = offers_of(sim, "p")
    assert first.worker_id == "w0" and second.worker_id == "w1"
    assert second.at - first.at >= 2.0  # the offer timeout re-routed it
    assert second.generated_before == 0  # nothing reached the consumer from attempt 1
    assert sim.router.counters["offer_timeouts"] == 1
    # Attempt 1 ran to the end on w0 and its result arrived after the heal: dropped, counted.
    assert sim.workers["w0"].state.counters["finished"] == 2
    assert any(line.split()[1:4] == ["router", "<-", "result"] and "p#1 w0" in line for line in sim.log)
    assert sim.router.counters["stale_dropped"] >= 1
    outcome = sim.consumers["p"].outcomes[0]
    assert outcome.finish_reason == "length" and outcome.attempts == 2
    assert list(outcome.tokens) == expected_stream(sim, "p", 200)


def test_worker_crash_mid_decode_continues_elsewhere_without_gap_or_duplicate() -> None:
    sim = Simulation(small_cluster(), seed=11)
    sim.submit(request("c", tokens(5, 640), 40), at=0.5)
    assert sim.run(until=0.9) is False
    [first] = offers_of(sim, "c")
    delivered = len(sim.consumers["c"].stream)
    assert 5 <= delivered < 40
    sim.crash(first.worker_id, at=sim.now, restart_after=1.0)
    assert sim.run(until=300.0)
    assert_invariants(sim)
    _, second = offers_of(sim, "c")
    assert second.worker_id != first.worker_id
    assert second.generated_before == delivered and second.prompt_tokens == 640 + delivered
    outcome = sim.consumers["c"].outcomes[0]
    assert outcome.finish_reason == "length" and outcome.attempts == 2
    assert list(outcome.tokens) == expected_stream(sim, "c", 40)


def test_offer_timeout_falls_back_to_another_worker() -> None:
    sim = warm_sim(seed=13, w1_back_at=1.5)
    sim.partition("router", "w0", start=2.0)  # offers to w0 vanish; its heartbeats still arrive
    sim.submit(request("t", PREFIX + tokens(4, 10), 8), at=2.0)
    assert sim.run(until=300.0)
    assert_invariants(sim)
    first, second = offers_of(sim, "t")
    assert (first.worker_id, first.route[0].tier) == ("w0", "gpu")
    assert second.worker_id == "w1" and second.at - first.at >= 2.0
    c = sim.consumers["t"]
    assert c.outcomes[0].finish_reason == "length"
    assert 2.0 < c.first_token_at - c.submitted_at < 2.5
    assert sim.router.counters["offer_timeouts"] == 1


def test_restarted_worker_serves_again_in_its_new_epoch() -> None:
    sim = Simulation(small_cluster(), seed=19)
    sim.crash("w1", at=0.0)  # w1 stays down
    sim.submit(request("before", tokens(6, 300), 5), at=0.5)
    sim.crash("w0", at=1.0, restart_after=0.5)
    sim.submit(request("after", tokens(7, 300), 5), at=2.0)
    assert sim.run(until=120.0)
    assert_invariants(sim)
    [before], [after] = offers_of(sim, "before"), offers_of(sim, "after")
    assert (before.worker_id, before.epoch) == ("w0", 1)
    assert (after.worker_id, after.epoch) == ("w0", 2)
    assert sim.consumers["after"].outcomes[0].finish_reason == "length"


def test_a_partition_past_the_expiry_fences_the_worker_and_it_comes_back_in_a_new_epoch() -> None:
    """One worker: its heartbeats are cut longer than the expiry, so the router fences its epoch. After the
    heal the router answers the old epoch's heartbeat with a fence notice, the worker moves to a new epoch,
    and the request it was running (waiting in the router queue meanwhile: no other server) continues there, gapless."""
    sim = Simulation(small_cluster(workers=1), seed=5)
    sim.submit(request("s", tokens(6, 640), 400), at=0.5)
    sim.partition("w0", "router", start=1.0, end=5.0)
    assert sim.run(until=300.0)
    assert_invariants(sim)
    first, second = offers_of(sim, "s")
    assert (first.worker_id, first.epoch) == ("w0", 1) and (second.worker_id, second.epoch) == ("w0", 2)
    assert second.at > 5.0 and second.generated_before > 0
    assert sim.router.counters["workers_expired"] == 1 and sim.router.counters["fenced_notices"] >= 1
    assert sim.workers["w0"].state.counters["epochs_ended"] == 1
    outcome = sim.consumers["s"].outcomes[0]
    assert outcome.finish_reason == "length" and outcome.attempts == 2
    assert list(outcome.tokens) == expected_stream(sim, "s", 400)
