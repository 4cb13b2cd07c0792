"""A worker that prices its requests in flight (``Heartbeat.per_request_s``, a vLLM engine's served fit): the
router counts them at once, from its own count, in the worker's queue (``predicted_ttft.queue_of``)."""

from __future__ import annotations

import pytest

from kvrelay.core.planning import predicted_ttft
from kvrelay.core.planning.roster import Roster
from kvrelay.core.router.events import SendOffer
from kvrelay.protocol.chunk_keys import prompt_chain
from kvrelay.protocol.messages import Heartbeat
from tests.support.router_driver import Driver, heartbeat, offers

PREFIX = tuple(range(1, 257))
CHAIN = prompt_chain(b"m", PREFIX, 64)


def engine(worker_id: str, per_request_s: float) -> Heartbeat:
    """A small model's engine: 20 us a prompt token, 10 ms fixed per first token."""
    return heartbeat(worker_id, prefill_s_per_token=2e-5, decode_s_per_token=0.01, per_request_s=per_request_s)


def test_the_queue_counts_the_routers_requests_in_flight_at_the_workers_price() -> None:
    view = predicted_ttft.WorkerView(
        engine("w0", 0.03), predicted_ttft.WorkerLoad(unheard_s=0.002, active=3), {"m": b"m"}
    )
    assert predicted_ttft.queue_of(view, 0.0) == pytest.approx(0.002 + 3 * 0.03)
    native = predicted_ttft.WorkerView(engine("w0", 0.0), predicted_ttft.WorkerLoad(active=3), {"m": b"m"})
    assert predicted_ttft.queue_of(native, 0.0) == 0.0
    # Running requests make the queue longer, not the worker busy: only prompt work queued does.
    running = predicted_ttft.WorkerView(engine("w1", 0.03), predicted_ttft.WorkerLoad(active=3), {"m": b"m"})
    roster = Roster()
    roster.put(running)
    assert predicted_ttft.queue_of(running, 0.0) == pytest.approx(0.09) and roster.busy_share() == 0.0
    roster.put(view)
    assert roster.busy_share() == 0.5


def start_two(d: Driver, per_request_s: float) -> tuple[SendOffer, SendOffer]:
    """Two engines, w0 holding ``PREFIX``; two requests sharing it, each accepted at once."""
    d.message(engine("w0", per_request_s))
    d.message(engine("w1", per_request_s))
    d.residency("w0", "gpu", CHAIN)
    (first,) = offers(d.request("r1", PREFIX + (900, 901)))
    d.accept(first)
    (second,) = offers(d.request("r2", PREFIX + (902, 903)))
    d.accept(second)
    return first, second


@pytest.mark.parametrize(("per_request_s", "second_goes_to"), [(0.03, "w1"), (0.0, "w0")])
def test_a_prefix_saving_less_than_a_request_in_flight_costs_goes_to_the_idle_engine(
    per_request_s: float, second_goes_to: str
) -> None:
    """w0 holds a 256-token prefix (5 ms of prefill): the first request reuses it. The second shares it too, but
    the first still runs on w0: where a request in flight costs a new one 30 ms, the idle w1 starts it sooner;
    a worker that prices none keeps the affinity."""
    first, second = start_two(Driver(), per_request_s)
    assert (first.worker_id, second.worker_id) == ("w0", second_goes_to)


def test_requests_that_end_leave_their_workers_queue_at_once() -> None:
    """Two requests run on w0, one on w1. When both of w0's end, w0's queue is empty before any heartbeat, and
    the roster, which plans alike workers in queue order and skips those that cannot win, has moved it: a cold
    request goes to w0 (kept in its old place, behind w1, w0 would not even be planned)."""
    d = Driver()
    first, second = start_two(d, 0.03)
    (third,) = offers(d.request("r3", PREFIX + (906, 907)))
    d.accept(third)
    assert (first.worker_id, second.worker_id, third.worker_id) == ("w0", "w1", "w0")
    for offer in (first, third):
        d.delta(offer.offer.assignment, "w0", 0, (5,))  # first tokens: no prompt work left on w0, two running
    for offer in (first, third):
        d.result(offer.offer.assignment, "w0", (6,))
    w0 = d.state.views["w0"]
    assert w0.load.active == 0 and predicted_ttft.queue_of(w0, d.now) == 0.0
    assert d.state.roster.busy_share() == 0.5  # w1 has the second's prompt queued
    (cold,) = offers(d.request("r4", tuple(range(5000, 5300))))
    assert cold.worker_id == "w0"
