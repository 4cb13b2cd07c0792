"""The worker side of the protocol as a pure state machine (docs/design.md sections 3 and 7).

``step(state, event) -> (state, effects)``: no I/O, no clock, no randomness. The
state is threaded linearly (``step`` mutates it; never reuse an old state).

Life of one assignment on this worker::

    OfferReceived --(epoch, model, context ok)--> admitting --RequestAdmission-->
    AdmissionDecided(accepted) --> running: OfferResult(accepted) + StartWork
    AdmissionDecided(declined) --> OfferResult(declined, reason), forgotten
    running --TokensProduced--> Delta(seq 0, 1, ...)            (per assignment)
    running --WorkFinished--> Result + ReleaseReservation, forgotten
    running --CancelReceived / superseded--> fenced: FenceWork at once, no further
        message for it; ReleaseReservation only on WorkQuiesced or WorkFinished,
        i.e. once the operation already in flight has finished.
    admitting --CancelReceived--> fenced while admitting: a later accepted
        decision is released at once, and nothing is sent.

Admission itself is injected: the machine emits ``RequestAdmission`` and the
interpreter answers with ``AdmissionDecided`` (a pure page-capacity model in the
simulator, a real page pool in the worker process). The machine validates the
epoch, the model, the context limit and shutdown itself, before asking.

Epochs: ``EpochEnded`` moves the machine to a newer epoch when the router has
fenced the current one; every assignment of the old epoch is fenced (the router
has re-routed them), and offers for the old epoch are declined ``wrong_epoch``.

Fencing: for each request the machine remembers the highest attempt it has seen
(bounded, oldest forgotten first). An offer or cancel for a lower attempt is
stale: a stale offer is dropped and counted; an offer for a higher attempt
supersedes (fences) the running lower one. A cancel that arrives before its offer
leaves a tombstone so the late offer is dropped, never run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import assert_never

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
    WorkerEffect,
    WorkerEvent,
    WorkFinished,
    WorkQuiesced,
)
from kvrelay.protocol.messages import (
    Assignment,
    Cancel,
    DeclineReason,
    Delta,
    Offer,
    OfferResult,
    Result,
)

DEFAULT_FENCE_MEMORY = 65536
"""How many requests' highest attempts the machine remembers for fencing."""


class SlotPhase(Enum):
    """Where an assignment stands on this worker (see the module docstring)."""

    ADMITTING = "admitting"
    ADMITTING_FENCED = "admitting_fenced"
    """Cancelled or superseded while its admission was being decided."""
    RUNNING = "running"
    FENCED = "fenced"
    """Cancelled or superseded while running; its reservation waits for the operation in flight."""


@dataclass(slots=True)
class Slot:
    """One assignment this worker knows: its offer, phase, next delta seq and tokens so far."""

    offer: Offer
    phase: SlotPhase
    seq: int = 0
    tokens: list[int] = field(default_factory=list)


@dataclass(slots=True)
class WorkerState:
    """The machine's state. ``slots`` holds every assignment that may still hold a reservation."""

    worker_id: str
    epoch: int
    models: tuple[str, ...]
    context_limit: int
    fence_memory: int = DEFAULT_FENCE_MEMORY
    shutting_down: bool = False
    slots: dict[Assignment, Slot] = field(default_factory=dict)
    latest_attempt: dict[str, int] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)


def new_worker(
    worker_id: str,
    epoch: int,
    models: tuple[str, ...],
    context_limit: int,
    fence_memory: int = DEFAULT_FENCE_MEMORY,
) -> WorkerState:
    """A fresh machine for one start (``epoch``) of a worker."""
    return WorkerState(worker_id, epoch, tuple(models), context_limit, fence_memory)


def holds_reservations(state: WorkerState) -> bool:
    """True while some assignment may still hold reserved pages (admitting, running or fenced)."""
    return bool(state.slots)


def step(state: WorkerState, event: WorkerEvent) -> tuple[WorkerState, list[WorkerEffect]]:
    """Apply one event; return the (same, mutated) state and the effects to carry out."""
    match event:
        case OfferReceived(offer=offer):
            return state, _on_offer(state, offer)
        case AdmissionDecided():
            return state, _on_admission(state, event)
        case CancelReceived(cancel=cancel):
            return state, _on_cancel(state, cancel)
        case TokensProduced():
            return state, _on_tokens(state, event)
        case WorkFinished():
            return state, _on_finished(state, event)
        case WorkQuiesced(assignment=assignment):
            return state, _on_quiesced(state, assignment)
        case ShutdownRequested():
            state.shutting_down = True
            return state, []
        case EpochEnded(epoch=epoch):
            return state, _on_epoch_ended(state, epoch)
        case _:
            assert_never(event)


def _count(state: WorkerState, name: str) -> None:
    state.counters[name] = state.counters.get(name, 0) + 1


def _remember_attempt(state: WorkerState, assignment: Assignment) -> None:
    latest = state.latest_attempt
    rid = assignment.request_id
    if latest.get(rid, 0) >= assignment.attempt:
        return
    latest.pop(rid, None)
    latest[rid] = assignment.attempt
    while len(latest) > state.fence_memory:
        del latest[next(iter(latest))]


def _decline(state: WorkerState, offer: Offer, reason: DeclineReason, detail: str) -> list[WorkerEffect]:
    _count(state, f"declined_{reason}")
    return [
        SendMessage(
            OfferResult(
                assignment=offer.assignment,
                worker_id=state.worker_id,
                epoch=state.epoch,
                accepted=False,
                reason=reason,
                detail=detail[:256],
            )
        )
    ]


def _fence(state: WorkerState, assignment: Assignment) -> list[WorkerEffect]:
    slot = state.slots[assignment]
    match slot.phase:
        case SlotPhase.ADMITTING:
            slot.phase = SlotPhase.ADMITTING_FENCED
            return []
        case SlotPhase.RUNNING:
            slot.phase = SlotPhase.FENCED
            return [FenceWork(assignment)]
        case SlotPhase.ADMITTING_FENCED | SlotPhase.FENCED:
            return []
        case _:
            assert_never(slot.phase)


def _on_offer(state: WorkerState, offer: Offer) -> list[WorkerEffect]:
    a = offer.assignment
    if a in state.slots:
        _count(state, "duplicate_offer")
        return []
    if state.latest_attempt.get(a.request_id, 0) >= a.attempt:
        _count(state, "stale_offer")
        return []
    effects: list[WorkerEffect] = []
    for older in [s for s in state.slots if s.request_id == a.request_id]:
        _count(state, "superseded")
        effects += _fence(state, older)
    _remember_attempt(state, a)
    if offer.worker_id != state.worker_id or offer.epoch != state.epoch:
        return effects + _decline(
            state,
            offer,
            DeclineReason.WRONG_EPOCH,
            f"offer for {offer.worker_id} epoch {offer.epoch}; this is {state.worker_id} epoch {state.epoch}",
        )
    if state.shutting_down:
        return effects + _decline(state, offer, DeclineReason.SHUTTING_DOWN, f"{state.worker_id} is shutting down")
    if offer.model not in state.models:
        return effects + _decline(
            state,
            offer,
            DeclineReason.WRONG_MODEL,
            f"model {offer.model!r} is not served; served: {', '.join(state.models)}",
        )
    needed = len(offer.prompt) + offer.max_new_tokens
    if needed > state.context_limit:
        return effects + _decline(
            state,
            offer,
            DeclineReason.OVER_CONTEXT_LIMIT,
            f"{needed} tokens exceed the context limit {state.context_limit}",
        )
    state.slots[a] = Slot(offer, SlotPhase.ADMITTING)
    return effects + [RequestAdmission(offer)]


def _on_admission(state: WorkerState, event: AdmissionDecided) -> list[WorkerEffect]:
    slot = state.slots.get(event.assignment)
    if slot is None or slot.phase not in (SlotPhase.ADMITTING, SlotPhase.ADMITTING_FENCED):
        raise ValueError(f"admission decided for {event.assignment} which is not awaiting admission")
    if slot.phase is SlotPhase.ADMITTING_FENCED:
        del state.slots[event.assignment]
        return [ReleaseReservation(event.assignment)] if event.accepted else []
    if not event.accepted:
        del state.slots[event.assignment]
        return _decline(state, slot.offer, event.reason or DeclineReason.NO_CAPACITY, event.detail)
    slot.phase = SlotPhase.RUNNING
    _count(state, "accepted")
    return [
        SendMessage(
            OfferResult(
                assignment=event.assignment,
                worker_id=state.worker_id,
                epoch=state.epoch,
                accepted=True,
            )
        ),
        StartWork(slot.offer),
    ]


def _on_cancel(state: WorkerState, cancel: Cancel) -> list[WorkerEffect]:
    a = cancel.assignment
    if a in state.slots:
        _count(state, "cancelled")
        return _fence(state, a)
    if state.latest_attempt.get(a.request_id, 0) < a.attempt:
        _count(state, "cancel_before_offer")
        _remember_attempt(state, a)
    else:
        _count(state, "cancel_ignored")
    return []


def _on_epoch_ended(state: WorkerState, epoch: int) -> list[WorkerEffect]:
    if epoch <= state.epoch:
        raise ValueError(f"epoch {epoch} does not follow epoch {state.epoch} of {state.worker_id}")
    _count(state, "epochs_ended")
    effects: list[WorkerEffect] = []
    for assignment in list(state.slots):
        _count(state, "cancelled")
        effects += _fence(state, assignment)
    state.epoch = epoch
    return effects


def _on_tokens(state: WorkerState, event: TokensProduced) -> list[WorkerEffect]:
    slot = state.slots.get(event.assignment)
    if slot is None or slot.phase is not SlotPhase.RUNNING:
        _count(state, "fenced_tokens_dropped")
        return []
    seq = slot.seq
    slot.seq += 1
    slot.tokens.extend(event.tokens)
    return [
        SendMessage(
            Delta(
                assignment=event.assignment,
                worker_id=state.worker_id,
                seq=seq,
                tokens=tuple(event.tokens),
            )
        )
    ]


def _on_finished(state: WorkerState, event: WorkFinished) -> list[WorkerEffect]:
    slot = state.slots.get(event.assignment)
    if slot is None:
        raise ValueError(f"work finished for {event.assignment} which holds no slot")
    del state.slots[event.assignment]
    if slot.phase is not SlotPhase.RUNNING:
        return [ReleaseReservation(event.assignment)]
    _count(state, "finished")
    return [
        SendMessage(
            Result(
                assignment=event.assignment,
                worker_id=state.worker_id,
                tokens=tuple(slot.tokens),
                finish_reason=event.finish_reason,
                usage=event.usage,
                timings=event.timings,
                error=event.error,
            )
        ),
        ReleaseReservation(event.assignment),
    ]


def _on_quiesced(state: WorkerState, assignment: Assignment) -> list[WorkerEffect]:
    slot = state.slots.get(assignment)
    if slot is None or slot.phase is not SlotPhase.FENCED:
        raise ValueError(f"work quiesced for {assignment} which is not fenced")
    del state.slots[assignment]
    return [ReleaseReservation(assignment)]
