"""The pure router: a fenced worker is told so and comes back in a new epoch without losing a request;
a request whose only server is gone waits for it (bounded); a drain refuses new requests and, at its
deadline, ends the running ones with an error that says how far they got."""

from __future__ import annotations

from kvrelay.core.router.events import DrainDeadline, DrainStarted, ErrorKind, Record, SendFenced, Tick
from kvrelay.core.router.machine import RouterConfig
from tests.support.router_driver import Driver, cancels, heartbeat, offers

PROMPT = tuple(range(1, 100))


def one_worker(**config: object) -> Driver:
    d = Driver(RouterConfig(**config))  # type: ignore[arg-type]
    d.message(heartbeat("w0"))
    return d


def test_a_heartbeat_of_an_expired_epoch_is_answered_with_a_fence_notice() -> None:
    d = one_worker(worker_expiry_s=3.0)
    d.now = 4.0
    d.feed(Tick(4.0))
    assert "w0" not in d.state.views
    fx = d.message(heartbeat("w0", seq=2))
    (notice,) = [e for e in fx if isinstance(e, SendFenced)]
    assert notice.worker_id == "w0" and notice.fenced.epoch == 1 and "newer epoch" in notice.fenced.reason
    assert "w0" not in d.state.views and d.state.counters["fenced_notices"] == 1
    assert not [e for e in d.message(heartbeat("w0", epoch=2, seq=1)) if isinstance(e, SendFenced)]
    assert d.state.views["w0"].heartbeat.epoch == 2


def test_the_only_workers_request_waits_for_its_new_epoch_and_continues_there() -> None:
    d = one_worker(worker_expiry_s=3.0)
    (first,) = offers(d.request("r", PROMPT, max_new=5))
    d.accept(first)
    d.delta(first.offer.assignment, "w0", 0, (7, 8))
    d.now = 4.0
    assert not offers(d.feed(Tick(4.0)))  # the epoch is fenced; no server is left: the request waits
    rs = d.state.requests["r"]
    assert rs.phase == "queued" and "r" not in d.results
    d.now = 4.5
    (second,) = offers(d.message(heartbeat("w0", epoch=2, seq=1)))
    o = second.offer
    assert o.epoch == 2 and o.assignment.attempt == 2 and o.prompt == PROMPT + (7, 8) and o.max_new_tokens == 3
    d.accept(second)
    d.result(o.assignment, "w0", (9, 10, 11))
    (res,) = d.results["r"]
    assert res.outcome.finish_reason == "length" and res.outcome.tokens == (7, 8, 9, 10, 11)


def test_a_request_whose_server_never_returns_fails_after_the_no_worker_wait_naming_the_model() -> None:
    d = one_worker(worker_expiry_s=3.0, no_worker_wait_s=10.0)
    (first,) = offers(d.request("r", PROMPT))
    d.accept(first)
    d.now = 4.0
    d.feed(Tick(4.0))
    d.now = 14.5
    d.feed(Tick(14.5))
    (res,) = d.results["r"]
    assert res.outcome.failure is not None and res.outcome.failure.kind is ErrorKind.NO_WORKER
    assert "for a worker serving model 'm' to come back" in res.outcome.failure.detail


def test_a_new_request_for_a_model_nobody_serves_still_fails_at_once() -> None:
    d = one_worker(worker_expiry_s=3.0)
    d.now = 4.0
    d.feed(Tick(4.0))
    d.request("r", PROMPT)
    (res,) = d.results["r"]
    assert res.outcome.failure is not None and res.outcome.failure.kind is ErrorKind.NO_WORKER


def test_a_drain_refuses_new_requests_and_its_deadline_ends_running_ones_with_how_far_they_got() -> None:
    d = one_worker()
    (running,) = offers(d.request("running", PROMPT, max_new=10))
    d.accept(running)
    d.delta(running.offer.assignment, "w0", 0, (7, 8, 9))
    d.feed(DrainStarted(d.now))
    d.request("late", PROMPT)
    (late,) = d.results["late"]
    assert late.outcome.failure is not None and late.outcome.failure.kind is ErrorKind.SHUTTING_DOWN
    assert "running" not in d.results  # the running request goes on during the drain
    d.delta(running.offer.assignment, "w0", 1, (10,))
    fx = d.feed(DrainDeadline(d.now))
    assert [c.cancel.assignment for c in cancels(fx)] == [running.offer.assignment]
    (res,) = d.results["running"]
    assert res.outcome.finish_reason == "error" and res.outcome.tokens == (7, 8, 9, 10)
    assert res.outcome.failure is not None and res.outcome.failure.kind is ErrorKind.SHUTTING_DOWN
    assert "4 of 10 tokens were delivered" in res.outcome.failure.detail
    outcomes = [e for e in d.effects if isinstance(e, Record) and e.kind == "outcome"]
    assert sorted(r.request_id for r in outcomes) == ["late", "running"]  # one outcome record each
    assert not d.state.requests
