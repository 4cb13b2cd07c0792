"""The pure router under load: requests wait in the router queue instead of failing, in order, within bounds."""

from __future__ import annotations

import math

import pytest

from kvrelay.core.router.events import ConsumerCancelled, Effect, ErrorKind, Request, RequestArrived, Tick
from kvrelay.core.router.machine import RouterConfig
from kvrelay.core.router.queue import QUEUE_OFF, Limits
from tests.support.router_driver import Driver, heartbeat, offers

PROMPT = tuple(range(1, 64 * 8 + 2))


def arrive(
    d: Driver, rid: str, *, priority: int = 0, user: str = "", model: str = "m", prompt: tuple[int, ...] = PROMPT
) -> list[Effect]:
    return d.feed(RequestArrived(d.now, Request(rid, model, prompt, 4, priority=priority, user=user)))


def busy_worker(config: RouterConfig | None = None) -> Driver:
    """One worker whose device queue is 10 s long, over the default start bound of 2 s."""
    d = Driver(config or RouterConfig())
    d.message(heartbeat("w0", queue_delay_s=10.0))
    return d


def offered(fx: list[Effect]) -> list[str]:
    return [o.offer.assignment.request_id for o in offers(fx)]


def test_a_request_waits_while_every_worker_is_busy_and_never_fails_for_it() -> None:
    d = busy_worker()
    assert not offers(arrive(d, "r"))
    assert d.state.requests["r"].phase == "queued"
    d.now = 1000.0
    d.message(heartbeat("w0", seq=2, queue_delay_s=10.0))
    d.feed(Tick(d.now))
    assert "r" not in d.results, "waiting longer than any timeout is not a failure"
    assert offered(d.message(heartbeat("w0", seq=3, queue_delay_s=0.0))) == ["r"]


def test_without_the_router_queue_a_busy_worker_gets_the_request_at_once() -> None:
    d = busy_worker(RouterConfig(queue=QUEUE_OFF))
    assert offered(arrive(d, "r")) == ["r"]


def test_a_new_request_waits_behind_those_already_waiting_in_the_policys_order() -> None:
    for policy, order in (("round_robin", ["big", "small"]), ("kvrelay", ["small", "big"])):
        d = Driver(policy=policy)
        d.message(heartbeat("w0", pages_free=3, pages_total=1000))
        assert not offers(arrive(d, "big"))  # needs 33 pages, 3 are free
        assert not offers(arrive(d, "small", prompt=(1, 2, 3)))  # would fit, but is not let past
        # FIFO for the peers; kvrelay's deadline (arrival + stretch x predicted prefill) puts the short one first
        assert offered(d.message(heartbeat("w0", seq=2, pages_free=1000))) == order, policy


def test_the_lower_priority_number_is_offered_first_when_room_appears() -> None:
    d = busy_worker()
    arrive(d, "batch", priority=5)
    arrive(d, "default")
    arrive(d, "urgent", priority=-1)
    assert offered(d.message(heartbeat("w0", seq=2, queue_delay_s=0.0))) == ["urgent", "default", "batch"]


def test_users_take_turns_while_they_wait() -> None:
    d = busy_worker()
    for i in range(3):
        arrive(d, f"alice{i}", user="alice")
    arrive(d, "bob0", user="bob")
    assert offered(d.message(heartbeat("w0", seq=2, queue_delay_s=0.0))) == ["alice0", "bob0", "alice1", "alice2"]


def test_a_full_queue_refuses_a_new_request_with_a_retry_after() -> None:
    d = busy_worker(RouterConfig(queue=Limits(max_requests=1)))
    arrive(d, "first")
    arrive(d, "second")
    (refused,) = d.results["second"]
    failure = refused.outcome.failure
    assert failure is not None and failure.kind is ErrorKind.QUEUE_FULL and failure.retry_after_s >= 1
    assert "1 requests are waiting" in failure.detail and d.state.counters["queue_refused"] == 1
    assert "first" not in d.results and d.state.queued() == 1


def test_a_request_larger_than_any_worker_fails_at_once_and_says_what_fits() -> None:
    d = Driver()
    d.message(heartbeat("w0", pages_free=3, pages_total=3))
    arrive(d, "huge")
    (result,) = d.results["huge"]
    failure = result.outcome.failure
    assert failure is not None and failure.kind is ErrorKind.NO_CAPACITY
    assert "holds 48 when idle: ask for at most 0 tokens" in failure.detail


def test_one_models_waiting_requests_do_not_hold_back_another_model() -> None:
    d = Driver()
    d.message(heartbeat("wa", models=("a",), queue_delay_s=10.0))
    d.message(heartbeat("wb", models=("b",)))
    assert not offers(arrive(d, "for-a", model="a"))
    assert offered(arrive(d, "for-b", model="b")) == ["for-b"]


def test_a_cancelled_waiting_request_leaves_the_queue() -> None:
    d = busy_worker()
    arrive(d, "r")
    d.feed(ConsumerCancelled(d.now, "r"))
    (result,) = d.results["r"]
    assert result.outcome.finish_reason == "cancelled" and d.state.queued() == 0
    assert not offers(d.message(heartbeat("w0", seq=2, queue_delay_s=0.0)))


def test_a_declined_request_comes_back_to_a_full_queue_first_and_is_never_refused() -> None:
    d = Driver(RouterConfig(queue=Limits(start_within_s=0.0, max_requests=1)))
    d.message(heartbeat("w0"))
    (first,) = offers(arrive(d, "first"))  # w0 is idle: it goes at once
    assert not offers(arrive(d, "second"))  # w0 now holds work: it waits, and the queue is full
    arrive(d, "third")
    assert d.results["third"][0].outcome.failure is not None
    assert not offers(d.decline(first, "no_capacity"))  # back in the full queue, not refused
    assert "first" not in d.results and d.state.queued() == 2
    (again,) = offers(d.message(heartbeat("w0", seq=2)))
    assert again.offer.assignment.request_id == "first" and again.offer.assignment.attempt == 2


def test_an_offer_counts_in_the_queue_until_a_heartbeat_made_after_its_acceptance_counts_it() -> None:
    """The router's queue of a worker is the heartbeat's plus the offers no heartbeat counts yet; once one
    does, the heartbeat stands for them, so a prefill half done counts half and the next request goes."""
    d = Driver(RouterConfig(queue=Limits(start_within_s=1.0)))
    d.message(heartbeat("w0"))
    long = tuple(range(1, 1601))  # 1.6 s of prefill at the heartbeat's 1 ms a token
    (first,) = offers(arrive(d, "a", prompt=long))
    load = d.state.views["w0"].load
    assert load.unheard_s == load.outstanding_s == pytest.approx(1.6)
    assert not offers(arrive(d, "b"))  # 1.6 s the heartbeat does not count, over the 1 s bound: b waits
    # A heartbeat made before the worker took the offer arrives first: the offer still counts.
    assert not offers(d.message(heartbeat("w0", seq=2, queue_delay_s=0.0)))
    d.accept(first)
    assert not offers(d.message(heartbeat("w0", seq=3, queue_delay_s=1.6)))  # it counts the offer now
    assert load.unheard_s == 0.0 and load.outstanding_s == pytest.approx(1.6)
    # Half the prompt is written: 0.8 s left, within the bound. The old rule (the larger of the heartbeat
    # and every offer without a first token) kept b waiting until a's first token.
    assert offered(d.message(heartbeat("w0", seq=4, queue_delay_s=0.8))) == ["b"]
    (b,) = [o for o in offers(d.effects) if o.offer.assignment.request_id == "b"]
    b_estimate = d.state.requests["b"].estimate_s
    assert load.unheard_s == b_estimate
    d.delta(b.offer.assignment, "w0", 0, (7,))  # b's first token: nothing of it is left to count
    assert load.unheard_s == 0.0


def test_kvrelay_passes_a_long_request_for_a_while_only_under_a_long_backlog_on_a_cluster_that_keeps_up() -> None:
    """One worker with no room; prefill 10 ms a token, so the 513-token prompt is 5.13 s of work (deadline
    arrival + 25.7 s, capped at arrival + ``PASS_LIMIT_S`` under a long backlog) and a 3-token one 0.03 s.
    ``sleepers`` are long requests of a later priority class (never ahead of class 0), waiting since -100 s
    and arriving slowly: 16 s of work each, they make the backlog long. A short request arriving 10 s
    after a long one goes first with a short backlog (shortest-first), second with a long one, and first
    again when a burst offers over twice the capacity."""
    cases = ((0, (), ["short", "old-long"]), (5, (), ["old-long", "short"]), (5, ("long-2", "long-3"), ["short"]))
    for sleepers, burst, order in cases:
        d = Driver(RouterConfig(queue=Limits(start_within_s=math.inf)))  # they wait for room only
        d.now = -100.0
        d.message(heartbeat("w0", pages_free=3, pages_total=1000, prefill_s_per_token=0.01))
        for i in range(sleepers):
            assert not offers(arrive(d, f"sleeper{i}", priority=9, prompt=tuple(range(1, 64 * 25))))
            d.now += 10.0
        d.now = 0.0
        assert not offers(arrive(d, "old-long"))
        d.now = 10.0
        for rid in burst:
            assert not offers(arrive(d, rid))
        assert not offers(arrive(d, "short", prompt=(1, 2, 3)))
        released = offered(d.message(heartbeat("w0", seq=2, pages_free=1000, prefill_s_per_token=0.01)))
        assert released[: len(order)] == order, (sleepers, burst)
