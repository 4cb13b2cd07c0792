"""The pure worker protocol machine: admission, deltas, results, cancellation and fencing."""

from __future__ import annotations

import pytest

from kvrelay.core.worker.events import (
    AdmissionDecided,
    CancelReceived,
    EpochEnded,
    FenceWork,
    OfferReceived,
    ReleaseReservation,
    RequestAdmission,
    SendMessage,
    ShutdownRequested,
    StartWork,
    TokensProduced,
    WorkFinished,
    WorkQuiesced,
)
from kvrelay.core.worker.machine import (
    WorkerState,
    holds_reservations,
    new_worker,
    step,
)
from kvrelay.protocol.messages import (
    Assignment,
    Cancel,
    Delta,
    Offer,
    OfferResult,
    Result,
    Usage,
)


def offer(
    rid: str = "r1",
    attempt: int = 1,
    *,
    epoch: int = 2,
    model: str = "m",
    prompt_len: int = 10,
    max_new: int = 4,
    worker_id: str = "w0",
) -> Offer:
    return Offer(
        assignment=Assignment(rid, attempt),
        worker_id=worker_id,
        epoch=epoch,
        model=model,
        prompt=tuple(range(prompt_len)),
        max_new_tokens=max_new,
    )


def machine() -> WorkerState:
    return new_worker("w0", 2, ("m",), context_limit=64)


def messages(effects: list) -> list:
    return [e.message for e in effects if isinstance(e, SendMessage)]


def accepted(state: WorkerState, o: Offer) -> list:
    state, effects = step(state, OfferReceived(0.0, o))
    assert effects == [RequestAdmission(o)]
    state, effects = step(state, AdmissionDecided(0.0, o.assignment, True))
    return effects


def test_accept_then_deltas_then_result_releases_reservation() -> None:
    s, o = machine(), offer()
    effects = accepted(s, o)
    assert effects == [
        SendMessage(OfferResult(assignment=o.assignment, worker_id="w0", epoch=2, accepted=True)),
        StartWork(o),
    ]
    _, e1 = step(s, TokensProduced(1.0, o.assignment, (5,)))
    _, e2 = step(s, TokensProduced(1.1, o.assignment, (6, 7)))
    assert [m.seq for m in messages(e1 + e2)] == [0, 1]
    assert [m.tokens for m in messages(e1 + e2)] == [(5,), (6, 7)]
    usage = Usage(prompt_tokens=10, generated_tokens=3)
    _, e3 = step(s, WorkFinished(1.2, o.assignment, "length", usage=usage))
    result = messages(e3)[0]
    assert isinstance(result, Result) and result.tokens == (5, 6, 7) and result.usage == usage
    assert e3[-1] == ReleaseReservation(o.assignment)
    assert not holds_reservations(s)


@pytest.mark.parametrize(
    ("o", "reason"),
    [
        (offer(epoch=1), "wrong_epoch"),
        (offer(worker_id="w9"), "wrong_epoch"),
        (offer(model="other"), "wrong_model"),
        (offer(prompt_len=60, max_new=5), "over_context_limit"),
    ],
)
def test_validation_declines_before_asking_admission(o: Offer, reason: str) -> None:
    s = machine()
    _, effects = step(s, OfferReceived(0.0, o))
    [msg] = messages(effects)
    assert len(effects) == 1 and isinstance(msg, OfferResult)
    assert not msg.accepted and msg.reason == reason and msg.detail
    assert not holds_reservations(s)


def test_admission_decline_is_forwarded_with_its_reason() -> None:
    s, o = machine(), offer()
    step(s, OfferReceived(0.0, o))
    _, effects = step(s, AdmissionDecided(0.0, o.assignment, False, "stale_route", "gpu prefix evicted"))
    [msg] = messages(effects)
    assert (msg.accepted, msg.reason, msg.detail) == (False, "stale_route", "gpu prefix evicted")
    assert not holds_reservations(s)


def test_shutdown_declines_new_offers() -> None:
    s = machine()
    step(s, ShutdownRequested(0.0))
    _, effects = step(s, OfferReceived(0.0, offer()))
    assert messages(effects)[0].reason == "shutting_down"


def test_cancel_before_acceptance_releases_a_late_grant_and_sends_nothing() -> None:
    s, o = machine(), offer()
    step(s, OfferReceived(0.0, o))
    _, effects = step(s, CancelReceived(0.1, Cancel(assignment=o.assignment, worker_id="w0")))
    assert effects == [] and holds_reservations(s)
    _, effects = step(s, AdmissionDecided(0.2, o.assignment, True))
    assert effects == [ReleaseReservation(o.assignment)]
    assert not holds_reservations(s)


def test_cancel_during_decode_fences_at_once_and_releases_only_when_quiesced() -> None:
    s, o = machine(), offer()
    accepted(s, o)
    step(s, TokensProduced(1.0, o.assignment, (1,)))
    _, effects = step(s, CancelReceived(1.1, Cancel(assignment=o.assignment, worker_id="w0")))
    assert effects == [FenceWork(o.assignment)]
    _, effects = step(s, TokensProduced(1.2, o.assignment, (2,)))
    assert effects == [] and s.counters["fenced_tokens_dropped"] == 1
    assert holds_reservations(s)
    _, effects = step(s, WorkQuiesced(1.3, o.assignment))
    assert effects == [ReleaseReservation(o.assignment)]
    assert not holds_reservations(s)


def test_work_finishing_after_fence_counts_as_quiescence_without_a_result() -> None:
    s, o = machine(), offer()
    accepted(s, o)
    step(s, CancelReceived(1.0, Cancel(assignment=o.assignment, worker_id="w0")))
    _, effects = step(s, WorkFinished(1.1, o.assignment, "length"))
    assert effects == [ReleaseReservation(o.assignment)]


def test_cancel_before_offer_leaves_a_tombstone() -> None:
    s, o = machine(), offer(attempt=3)
    _, effects = step(s, CancelReceived(0.0, Cancel(assignment=o.assignment, worker_id="w0")))
    assert effects == []
    _, effects = step(s, OfferReceived(0.1, o))
    assert effects == [] and s.counters["stale_offer"] == 1
    assert not holds_reservations(s)


def test_newer_attempt_supersedes_and_older_offer_is_stale() -> None:
    s = machine()
    first, second = offer(attempt=1), offer(attempt=2)
    accepted(s, first)
    _, effects = step(s, OfferReceived(1.0, second))
    assert effects == [FenceWork(first.assignment), RequestAdmission(second)]
    _, effects = step(s, TokensProduced(1.1, first.assignment, (9,)))
    assert effects == []
    _, effects = step(s, OfferReceived(1.2, offer(attempt=1)))
    assert effects == [] and s.counters["duplicate_offer"] == 1
    step(s, WorkQuiesced(1.3, first.assignment))
    step(s, AdmissionDecided(1.4, second.assignment, True))
    _, effects = step(s, TokensProduced(1.5, second.assignment, (4,)))
    assert messages(effects) == [Delta(assignment=second.assignment, worker_id="w0", seq=0, tokens=(4,))]


def test_fence_memory_is_bounded() -> None:
    s = new_worker("w0", 2, ("m",), context_limit=64, fence_memory=3)
    for i in range(10):
        step(s, CancelReceived(0.0, Cancel(assignment=Assignment(f"r{i}", 1), worker_id="w0")))
    assert list(s.latest_attempt) == ["r7", "r8", "r9"]


def test_runtime_protocol_violations_are_errors() -> None:
    s = machine()
    with pytest.raises(ValueError, match="not awaiting admission"):
        step(s, AdmissionDecided(0.0, Assignment("nope", 1), True))
    with pytest.raises(ValueError, match="not fenced"):
        step(s, WorkQuiesced(0.0, Assignment("nope", 1)))


def test_a_fenced_epoch_fences_every_assignment_and_offers_of_the_old_epoch_are_declined() -> None:
    state = machine()
    accepted(state, offer("running"))
    step(state, OfferReceived(0.0, offer("admitting")))
    state, effects = step(state, EpochEnded(1.0, 3))
    assert effects == [FenceWork(Assignment("running", 1))]
    assert state.epoch == 3 and state.counters["epochs_ended"] == 1
    # nothing more is sent for either: the running one quiesces, the late grant is released at once
    state, effects = step(state, TokensProduced(1.0, Assignment("running", 1), (5,)))
    assert effects == []
    state, effects = step(state, AdmissionDecided(1.0, Assignment("admitting", 1), True))
    assert effects == [ReleaseReservation(Assignment("admitting", 1))]
    state, effects = step(state, WorkQuiesced(1.0, Assignment("running", 1)))
    assert effects == [ReleaseReservation(Assignment("running", 1))] and not holds_reservations(state)
    state, effects = step(state, OfferReceived(2.0, offer("late", epoch=2)))
    (declined,) = messages(effects)
    assert isinstance(declined, OfferResult) and declined.reason == "wrong_epoch" and declined.epoch == 3
    state, effects = step(state, OfferReceived(2.0, offer("new", epoch=3)))
    assert effects == [RequestAdmission(offer("new", epoch=3))]
    with pytest.raises(ValueError, match="does not follow"):
        step(state, EpochEnded(3.0, 3))
