"""The pure router: fencing, re-routing, continuations, cancellation, registry and index."""

from __future__ import annotations

import pytest

from kvrelay.core.router.events import (
    CancelTimer,
    ConsumerCancelled,
    DeliverResult,
    Record,
    SendOffer,
    StartTimer,
    Tick,
    TimerFired,
    WorkerUnavailable,
)
from kvrelay.core.router.machine import RouterConfig
from kvrelay.core.router.reuse import ReuseFigures, reuse_figures
from kvrelay.protocol.chunk_keys import prompt_chain
from kvrelay.protocol.messages import Assignment, Residency, Result, Usage
from tests.support.router_driver import Driver, cancels, heartbeat, offers

PROMPT = tuple(range(1, 64 * 8 + 2))  # 8 cacheable chunks
CHAIN = prompt_chain(b"m", PROMPT, 64)


def two_workers(**config: object) -> Driver:
    d = Driver(RouterConfig(**config))  # type: ignore[arg-type]
    d.message(heartbeat("w0"))
    d.message(heartbeat("w1"))
    return d


def test_happy_path_delivers_one_gapless_stream_and_one_result() -> None:
    d = two_workers()
    (offer,) = offers(d.request("r", PROMPT, max_new=4))
    assert offer.offer.assignment == Assignment("r", 1)
    assert offer.offer.prompt == PROMPT and offer.offer.max_new_tokens == 4
    fx = d.accept(offer)
    assert any(isinstance(e, CancelTimer) for e in fx) and any(isinstance(e, StartTimer) for e in fx)
    a, w = offer.offer.assignment, offer.worker_id
    d.delta(a, w, 0, (10, 11))
    d.delta(a, w, 1, (12,))
    d.result(a, w, (10, 11, 12, 13))
    assert d.streams["r"] == [10, 11, 12, 13]
    (res,) = d.results["r"]
    assert res.outcome.finish_reason == "length" and res.outcome.tokens == (10, 11, 12, 13)
    assert "r" not in d.state.requests


def test_out_of_order_and_duplicate_deltas_are_reassembled() -> None:
    d = two_workers()
    (offer,) = offers(d.request("r", PROMPT, max_new=4))
    d.accept(offer)
    a, w = offer.offer.assignment, offer.worker_id
    d.delta(a, w, 1, (12,))
    assert d.streams.get("r", []) == []
    d.delta(a, w, 0, (10, 11))
    d.delta(a, w, 0, (10, 11))
    assert d.streams["r"] == [10, 11, 12]
    assert d.state.counters["duplicate_dropped"] == 1


def test_offer_timeout_reroutes_and_late_messages_of_attempt_1_complete_nothing() -> None:
    d = two_workers(offer_timeout_s=1.0)
    (first,) = offers(d.request("r", PROMPT))
    d.now = 1.0
    fx = d.feed(TimerFired(1.0, ("offer", "r", 1)))
    (cancel,) = cancels(fx)
    assert cancel.worker_id == first.worker_id and cancel.cancel.assignment == Assignment("r", 1)
    (second,) = offers(fx)
    assert second.offer.assignment == Assignment("r", 2)
    assert second.worker_id != first.worker_id
    # The late acceptance of attempt 1 is stale: it gets a cancel back; its result completes nothing.
    fx = d.accept(first)
    assert [c.cancel.assignment for c in cancels(fx)] == [Assignment("r", 1)]
    d.result(first.offer.assignment, first.worker_id, (1, 2, 3, 4))
    assert "r" not in d.results and d.streams.get("r", []) == []
    assert d.state.counters["stale_dropped"] == 2 and d.state.counters["stale_accept_cancelled"] == 1
    d.accept(second)
    d.result(second.offer.assignment, second.worker_id, (5, 6, 7, 8))
    assert d.streams["r"] == [5, 6, 7, 8] and len(d.results["r"]) == 1


def test_worker_loss_mid_decode_continues_as_a_continuation_elsewhere() -> None:
    d = two_workers()
    (first,) = offers(d.request("r", PROMPT, max_new=5))
    d.accept(first)
    d.delta(first.offer.assignment, first.worker_id, 0, (7, 8))
    fx = d.feed(WorkerUnavailable(d.now, first.worker_id, 1))
    (second,) = offers(fx)
    o = second.offer
    assert second.worker_id != first.worker_id
    assert o.prompt == PROMPT + (7, 8) and o.generated_before == 2 and o.max_new_tokens == 3
    d.accept(second)
    d.delta(o.assignment, second.worker_id, 0, (9,))
    # A delta from the lost attempt arrives late: dropped, never delivered.
    d.delta(first.offer.assignment, first.worker_id, 1, (99,))
    d.result(o.assignment, second.worker_id, (9, 10, 11))
    assert d.streams["r"] == [7, 8, 9, 10, 11]
    (res,) = d.results["r"]
    assert res.outcome.tokens == (7, 8, 9, 10, 11) and res.outcome.attempts == 2


def test_consumer_cancel_fences_at_once() -> None:
    d = two_workers()
    (offer,) = offers(d.request("r", PROMPT))
    d.accept(offer)
    fx = d.feed(ConsumerCancelled(d.now, "r"))
    assert [c.cancel.assignment for c in cancels(fx)] == [Assignment("r", 1)]
    (res,) = d.results["r"]
    assert res.outcome.finish_reason == "cancelled"
    d.delta(offer.offer.assignment, offer.worker_id, 0, (1,))
    d.result(offer.offer.assignment, offer.worker_id, (1, 2, 3, 4))
    assert len(d.results["r"]) == 1 and d.streams.get("r", []) == []


def test_cancel_before_acceptance_and_twice() -> None:
    d = two_workers()
    (offer,) = offers(d.request("r", PROMPT))
    d.feed(ConsumerCancelled(d.now, "r"))
    d.feed(ConsumerCancelled(d.now, "r"))
    assert len(d.results["r"]) == 1
    assert cancels(d.accept(offer))  # the late acceptance is answered with a cancel


def test_stale_gpu_decline_keeps_lower_tier_alternatives_of_the_same_worker() -> None:
    d = Driver()
    d.message(heartbeat("w0", queue_delay_s=0.0))
    d.message(heartbeat("w1", queue_delay_s=5.0))  # far worse
    d.residency("w0", "gpu", CHAIN)
    d.residency("w0", "ram", CHAIN, seq=2)
    (offer,) = offers(d.request("r", PROMPT))
    assert offer.worker_id == "w0" and [s.tier for s in offer.offer.route] == ["gpu"]
    (again,) = offers(d.decline(offer, "stale_route"))
    assert again.worker_id == "w0" and [s.tier for s in again.offer.route] == ["ram"]
    assert again.offer.assignment.attempt == 2
    assert d.state.requests["r"].reasons == ["w0: declined: stale_route"]


def test_unserved_model_fails_with_the_served_models_named() -> None:
    d = two_workers()
    d.request("r", PROMPT, model="nope")
    (res,) = d.results["r"]
    assert res.outcome.finish_reason == "error"
    assert "model 'nope' is not served; served models: m" in (res.outcome.error or "")


def test_a_prompt_over_every_context_limit_fails_with_the_first_servers_exclusion() -> None:
    d = Driver()
    d.message(heartbeat("w0", context_limit=100))
    d.message(heartbeat("w1", context_limit=200))
    d.request("r", PROMPT, max_new=4)
    (res,) = d.results["r"]
    assert res.outcome.finish_reason == "error"
    assert res.outcome.error == f"over_context_limit: context limit 100 < {len(PROMPT) + 4}"


def test_a_request_every_server_failed_forgets_the_failures_and_waits_for_a_heartbeat() -> None:
    d = Driver()
    d.message(heartbeat("w0"))
    (offer,) = offers(d.request("r", PROMPT))
    assert not offers(d.decline(offer, "wrong_epoch"))
    rs = d.state.requests["r"]
    assert rs.phase == "queued" and not rs.excluded_workers
    (again,) = offers(d.message(heartbeat("w0", seq=2)))
    assert again.worker_id == "w0" and again.offer.assignment.attempt == 2


def test_capacity_shortage_waits_in_the_queue_until_a_heartbeat_shows_room() -> None:
    d = Driver()
    d.message(heartbeat("w0", pages_free=3, pages_total=1000))
    assert not offers(d.request("r", PROMPT))
    assert d.state.requests["r"].phase == "queued"
    fx = d.message(heartbeat("w0", seq=2, pages_free=1000))
    assert len(offers(fx)) == 1


def running_r1(pages_free: int) -> tuple[Driver, SendOffer]:
    """One worker reporting ``pages_free`` free pages, running r1 (33 pages: 513 prompt tokens, 4 new ones)."""
    d = Driver()
    d.message(heartbeat("w0", pages_free=pages_free))
    (first,) = offers(d.request("r1", PROMPT))
    d.accept(first)
    return d, first


def test_an_accepted_request_that_ends_before_the_next_heartbeat_gives_its_pages_back() -> None:
    # 40 free pages of 16 tokens; each request needs 33 (513 prompt tokens and 4 new ones): one at a time fits.
    d, first = running_r1(pages_free=40)
    assert not offers(d.request("r2", PROMPT)), "the worker's pages are held by r1, which the router knows of"
    assert d.state.requests["r2"].phase == "queued"
    fx = d.result(first.offer.assignment, first.worker_id, (1, 2, 3, 4))
    (second,) = offers(fx)  # r1 ended and no heartbeat came since: its pages are back at once
    assert second.offer.assignment.request_id == "r2"
    assert d.state.views["w0"].load.accepted_pages == 0 and d.state.views["w0"].load.inflight_pages == 33


def test_pages_a_heartbeat_reported_in_use_come_back_when_their_request_ends() -> None:
    d, first = running_r1(pages_free=40)
    d.message(heartbeat("w0", seq=2, pages_free=7))  # the worker's report counts r1's 33 pages
    assert not offers(d.request("r2", PROMPT)), "7 free pages as reported, r1 still running: r2 waits"
    (second,) = offers(d.result(first.offer.assignment, first.worker_id, (1, 2, 3, 4)))
    assert second.offer.assignment.request_id == "r2"
    load = d.state.views["w0"].load
    assert (load.released_pages, load.inflight_pages) == (33, 33)
    d.message(heartbeat("w0", seq=3, pages_free=40))  # the next report frees r1's pages itself
    assert (load.released_pages, load.accepted_pages) == (0, 0)


def test_registry_rejects_old_heartbeats_and_a_new_epoch_fences_the_old() -> None:
    d = two_workers()
    assert not d.message(heartbeat("w0", seq=1))
    assert d.state.counters["stale_heartbeat"] == 1
    (offer,) = offers(d.request("r", PROMPT))
    d.accept(offer)
    fx = d.message(heartbeat(offer.worker_id, epoch=2, seq=1))
    (again,) = offers(fx)
    assert again.offer.assignment.attempt == 2
    # The old epoch can no longer come back.
    d.message(heartbeat(offer.worker_id, epoch=1, seq=99))
    assert d.state.views[offer.worker_id].heartbeat.epoch == 2


def test_silent_worker_expires_on_tick_and_its_residency_is_dropped() -> None:
    d = two_workers(worker_expiry_s=3.0)
    d.residency("w0", "gpu", CHAIN)
    assert len(d.state.index) == len(CHAIN)
    d.now = 2.0
    d.message(heartbeat("w1", seq=2))
    d.now = 4.0
    d.feed(Tick(4.0))
    assert "w0" not in d.state.views and "w1" in d.state.views
    assert len(d.state.index) == 0


def test_residency_of_an_old_epoch_is_ignored() -> None:
    d = two_workers()
    d.message(heartbeat("w0", epoch=2, seq=1))
    d.residency("w0", "gpu", CHAIN, epoch=1, seq=5)
    assert len(d.state.index) == 0 and d.state.counters["stale_residency"] == 1


def test_every_offer_is_recorded_as_a_decision_with_terms() -> None:
    d = two_workers()
    d.request("r", PROMPT)
    (rec,) = [e for e in d.effects if isinstance(e, Record) and e.kind == "decision"]
    chosen = rec.data["chosen"]
    assert rec.data["policy"] == "kvrelay" and chosen.worker_id == "w0"
    # the other worker is either a planned candidate or pruned with a bound no better than the winner's
    planned = {c.worker_id for c in rec.data["candidates"]}
    assert "w0" in planned and ("w1" in planned or rec.data["pruned"]["w1"] >= chosen.predicted_ttft_s)
    assert abs(chosen.predicted_ttft_s - chosen.terms.total_s) < 1e-12


def test_max_attempts_ends_the_request_with_an_error() -> None:
    d = two_workers(max_attempts=2)
    d.request("r", PROMPT)
    d.feed(TimerFired(5.0, ("offer", "r", 1)))
    d.feed(TimerFired(10.0, ("offer", "r", 2)))
    (res,) = d.results["r"]
    assert res.outcome.finish_reason == "error" and "gave up after 2 attempts" in (res.outcome.error or "")
    assert isinstance(res, DeliverResult)


def test_a_workers_new_epoch_asks_for_its_durable_replicas_and_they_feed_the_candidates() -> None:
    from kvrelay.core.router.events import (
        LoadReplicas,
        MessageReceived,
        ReplicasKnown,
        Request,
        RequestArrived,
    )
    from kvrelay.core.router.machine import request_chain

    d = Driver()
    rates = {"ram": 1e9, "ssd": 2.5e8, "peer": 1e7, "object": 1e7}
    assert d.feed(MessageReceived(d.now, heartbeat("w0", restore_bytes_per_s=rates))) == [LoadReplicas("w0")]
    assert d.feed(MessageReceived(d.now, heartbeat("w1", restore_bytes_per_s=rates))) == [LoadReplicas("w1")]
    assert d.feed(MessageReceived(d.now, heartbeat("w1", seq=2, restore_bytes_per_s=rates))) == []  # same epoch
    request = Request("r", "m", PROMPT, 4)
    chain = request_chain(d.state, request)
    assert chain == CHAIN
    facts = tuple((k, "ssd", "w1") for k in chain) + ((chain[0], "ssd", "gone-worker"),)
    assert d.feed(ReplicasKnown(d.now, facts)) == []
    (offer,) = offers(d.feed(RequestArrived(d.now, request)))
    assert offer.worker_id == "w1" and [(s.tier, s.chunks) for s in offer.offer.route] == [("ssd", 8)]
    assert "gone-worker" not in d.state.index.slots  # replicas of workers that are not live are not learned
    restarted = d.feed(MessageReceived(d.now, heartbeat("w1", epoch=2, seq=1, restore_bytes_per_s=rates)))
    assert LoadReplicas("w1") in restarted


def test_durable_residency_becomes_replica_records() -> None:
    d = two_workers()
    d.residency("w0", "gpu", CHAIN[:2])
    d.message(Residency(worker_id="w0", epoch=1, seq=2, tier="ssd", stored=CHAIN[:3]))
    (rec,) = [e for e in d.effects if isinstance(e, Record) and e.kind == "replica"]
    assert rec.data == {"worker_id": "w0", "tier": "ssd", "stored": CHAIN[:3], "removed": ()}


def test_a_peer_segment_names_the_peer_by_the_url_it_serves_chunks_on() -> None:
    d = Driver()
    rates = {"ram": 1e9, "ssd": 2.5e8, "peer": 1e9, "object": 1e7}
    d.message(heartbeat("w0", restore_bytes_per_s=rates))
    d.message(heartbeat("w1", queue_delay_s=9.0, restore_bytes_per_s=rates, peer_url="http://127.0.0.1:7001"))
    d.residency("w1", "ram", CHAIN)
    (offer,) = offers(d.request("r", PROMPT))
    assert offer.worker_id == "w0"
    assert [(s.tier, s.chunks, s.source) for s in offer.offer.route] == [("peer", 8, "http://127.0.0.1:7001")]


def test_reuse_figures_count_what_was_held_what_the_route_took_and_what_the_worker_found() -> None:
    d = Driver(policy="round_robin")
    d.message(heartbeat("w0"))
    d.message(heartbeat("w1"))
    d.residency("w1", "gpu", CHAIN[:5])
    (first,) = offers(d.request("r1", PROMPT))
    assert first.worker_id == "w0"  # round robin ignores the 5 chunks w1 holds
    assert reuse_figures(d.state.counters) == ReuseFigures(available_tokens=5 * 64)
    (second,) = offers(d.request("r2", PROMPT))
    assert second.worker_id == "w1" and [(s.tier, s.chunks) for s in second.offer.route] == [("gpu", 5)]
    assert reuse_figures(d.state.counters) == ReuseFigures(available_tokens=10 * 64, captured_tokens=5 * 64)
    d.accept(second)
    d.message(
        Result(
            assignment=second.offer.assignment,
            worker_id="w1",
            tokens=(1, 2, 3, 4),
            finish_reason="length",
            usage=Usage(cached_tokens={"gpu": 4 * 64}),
        )
    )
    figures = reuse_figures(d.state.counters)
    assert figures.delivered_tokens == 4 * 64 == sum(d.results["r2"][0].outcome.usage.cached_tokens.values())
    assert (figures.captured_share, figures.delivered_share) == (0.5, 0.4)


def test_a_residency_snapshot_makes_the_index_list_exactly_what_the_worker_holds() -> None:
    """A restarted worker whose chunk directory was wiped: the replica facts of its old epoch name ssd chunks it
    no longer has; its snapshot on reconnect removes them from the index and records their removal."""
    from kvrelay.core.router.events import ReplicasKnown

    d = two_workers()
    d.message(heartbeat("w0", epoch=2, seq=1))
    d.feed(ReplicasKnown(d.now, tuple((k, "ssd", "w0") for k in CHAIN[:4])))
    d.residency("w0", "gpu", CHAIN[:2], epoch=2, seq=1)
    assert d.state.index.keys_of("w0", "ssd") == sorted(CHAIN[:4])
    d.effects.clear()
    snapshot = Residency(worker_id="w0", epoch=2, seq=2, tier="ssd", stored=CHAIN[3:5], replace=True)
    d.message(snapshot)
    assert sorted(d.state.index.keys_of("w0", "ssd")) == sorted(CHAIN[3:5])
    assert d.state.index.keys_of("w0", "gpu") == sorted(CHAIN[:2])  # other tiers untouched
    (rec,) = [e for e in d.effects if isinstance(e, Record) and e.kind == "replica"]
    assert rec.data == {"worker_id": "w0", "tier": "ssd", "stored": CHAIN[4:5], "removed": tuple(sorted(CHAIN[:3]))}
    d.message(Residency(worker_id="w0", epoch=2, seq=3, tier="ssd", stored=CHAIN[6:7]))  # a later part adds
    d.message(Residency(worker_id="w0", epoch=2, seq=4, tier="gpu", replace=True))  # an empty tier
    assert sorted(d.state.index.keys_of("w0", "ssd")) == sorted(CHAIN[3:5] + CHAIN[6:7])
    assert d.state.index.keys_of("w0", "gpu") == []
    assert d.state.counters["residency_snapshots"] == 2


@pytest.mark.parametrize(("late_s", "expired"), [(0.0, True), (2.0, False)])
def test_a_late_tick_does_not_blame_the_workers_for_the_routers_own_pause(late_s: float, expired: bool) -> None:
    """w0 was last heard at 0; a tick at 4 s expires it (3 s expiry), unless the router's own process did not run
    for 2 s of those 4 (the tick came 2 s late): its heartbeats of that time wait unread behind the pause."""
    d = two_workers(worker_expiry_s=3.0)
    d.now = 2.0
    d.message(heartbeat("w1", seq=2))
    d.now = 4.0
    d.feed(Tick(4.0, late_s))
    assert ("w0" not in d.state.views) is expired and "w1" in d.state.views


def test_an_ended_request_gives_back_only_the_pages_no_follower_on_its_worker_shares() -> None:
    d, first = running_r1(pages_free=100)
    d.message(heartbeat("w0", seq=2, pages_free=67))  # counts r1's 33 pages
    d.residency("w0", "gpu", CHAIN)  # r1's prefill stored its 8 chunks
    (follower,) = offers(d.request("r2", PROMPT[:-1] + (9,)))  # the same 8 chunks, from w0's device
    d.accept(follower)
    assert d.state.requests["r2"].demand_pages == 1, "the follower's demand leaves out the 32 pages it shares"
    d.result(first.offer.assignment, first.worker_id, (1, 2, 3, 4))
    # r1's 8 chunks (32 pages of 16 tokens) stay in use under r2: only its last page comes back.
    assert d.state.views["w0"].load.released_pages == 1
