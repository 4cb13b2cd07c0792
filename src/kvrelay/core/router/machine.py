"""The router as a pure state machine: ``step(state, event) -> (state, effects)``.

Fencing (docs/design.md section 3): every request has one current attempt. A
message whose assignment is not the request's current one, or that comes from
another worker than the one holding it, is stale: it is dropped and counted
(``counters["stale_dropped"]``), never delivered, never completes anything; a
stale acceptance is answered with a cancel. Offer timeouts, declines, worker
loss, silence after acceptance, and worker-side failures re-route with
attempt + 1; once tokens reached the consumer the next attempt is a
continuation (prompt + delivered tokens, remaining budget), so the consumer
sees one gapless, duplicate-free stream. Each request gets exactly one
``DeliverResult``. Requests no worker can start soon wait in the router queue
(``router.queue``); after every event that may have made room (a heartbeat, a
first token, an attempt's end, a tick) the queue's head is tried again.
"""

from __future__ import annotations

from typing import assert_never

from kvrelay.core.planning import predicted_ttft
from kvrelay.core.planning.registry import HeartbeatReason, accept_heartbeat, credit_pause, expire, fence
from kvrelay.core.router.assignment_messages import on_assignment_message
from kvrelay.core.router.attempts import (
    abandon,
    dispatch,
    finish,
    route,
)
from kvrelay.core.router.events import (
    ConsumerCancelled,
    DeliverResult,
    DrainDeadline,
    DrainStarted,
    Effect,
    ErrorKind,
    LoadReplicas,
    MessageReceived,
    OfferOutcome,
    Outcome,
    Record,
    RecordKind,
    ReplicasKnown,
    Request,
    RequestArrived,
    RequestError,
    RouterEvent,
    SendCancel,
    SendFenced,
    StartTimer,
    Tick,
    TimerFired,
    TimerKey,
    TimerKind,
    WorkerUnavailable,
)
from kvrelay.core.router.state import (
    Phase,
    RequestState,
    RouterConfig,
    RouterState,
    new_router,
)
from kvrelay.protocol.chunk_keys import prompt_chain
from kvrelay.protocol.messages import (
    Assignment,
    Cancel,
    Delta,
    Fenced,
    FinishReason,
    Heartbeat,
    Offer,
    OfferResult,
    Residency,
    Result,
    WireMessage,
)

__all__ = ["RouterConfig", "RouterState", "new_router", "step"]

Effects = list[Effect]


def step(state: RouterState, event: RouterEvent) -> tuple[RouterState, Effects]:
    """Apply one event; return the updated state and the effects to carry out, in order."""
    fx: Effects = []
    match event:
        case RequestArrived(now=now, request=request):
            _on_request(state, request, now, fx)
        case ReplicasKnown(replicas=replicas):
            _learn_replicas(state, replicas)
        case MessageReceived(now=now, message=message):
            _on_message(state, message, now, fx)
        case TimerFired(now=now, timer=timer):
            _on_timer(state, timer, now, fx)
        case WorkerUnavailable(now=now, worker_id=wid, epoch=epoch):
            if fence(state.registry, wid, epoch):
                _worker_lost(state, wid, epoch, now, fx, "worker unavailable")
        case ConsumerCancelled(now=now, request_id=rid):
            _on_consumer_cancel(state, rid, now, fx)
        case Tick(now=now, late_s=late_s):
            if late_s > 0:
                credit_pause(state.registry, late_s)
            if expired := state.pending.expire(now):
                state.count("pending_expired", expired)
            for wid, epoch in expire(state.registry, now, state.config.worker_expiry_s):
                state.count("workers_expired")
                _worker_lost(state, wid, epoch, now, fx, "heartbeats stopped")
            state.wake = True
        case DrainStarted():
            state.draining = True
        case DrainDeadline(now=now):
            state.draining = True
            for rid in sorted(state.requests):
                _stop_for_shutdown(state, state.requests[rid], now, fx)
        case _:
            assert_never(event)
    if state.wake:
        dispatch(state, event.now, fx)
    return state, fx


# --- requests -----------------------------------------------------------------


def _learn_replicas(state: RouterState, replicas: tuple[tuple[bytes, str, str], ...]) -> None:
    """Merge durable replica facts into the index: object replicas always, local ones of live workers."""
    groups: dict[tuple[str, str], list[bytes]] = {}
    for key, tier, location in replicas:
        groups.setdefault((tier, location), []).append(key)
    for (tier, location), keys in groups.items():
        if tier == "object" or (tier in ("ram", "ssd") and location in state.views):
            state.index.store(location, tier, keys)


def request_chain(state: RouterState, request: Request) -> tuple[bytes, ...]:
    """The routable chunk chain of a new request, as the router will plan it (for fact lookups)."""
    if request.chain is not None:
        return request.chain
    fp = state.fingerprints.get(request.model) or request.model.encode()
    return prompt_chain(fp, request.prompt, state.config.chunk_tokens)


def _on_request(state: RouterState, request: Request, now: float, fx: Effects) -> None:
    if state.draining:
        state.count("refused_draining")
        rs = RequestState(request=request, arrived=now, fingerprint=b"")
        refused = RequestError(ErrorKind.SHUTTING_DOWN, "kvrelay is shutting down and takes no new requests")
        finish(state, rs, FinishReason.ERROR, now, fx, refused)
        return
    if request.request_id in state.requests:
        state.count("duplicate_request")
        rid = request.request_id
        duplicate = RequestError(ErrorKind.DUPLICATE_REQUEST, f"request id '{rid}' is already in flight")
        fx.append(DeliverResult(rid, Outcome(rid, FinishReason.ERROR, (), 0, failure=duplicate)))
        return
    fp = state.fingerprints.get(request.model) or request.model.encode()
    rs = RequestState(request=request, arrived=now, fingerprint=fp)
    state.requests[request.request_id] = rs
    route(state, rs, now, fx)


def _on_consumer_cancel(state: RouterState, rid: str, now: float, fx: Effects) -> None:
    rs = state.requests.get(rid)
    if rs is None:
        state.count("cancel_unknown")
        return
    if rs.worker_id is not None:
        wid = rs.worker_id
        fx.append(SendCancel(wid, Cancel(assignment=Assignment(rid, rs.attempt), worker_id=wid, reason="consumer")))
        fx.append(
            Record(
                RecordKind.OFFER_OUTCOME,
                rid,
                rs.attempt,
                now,
                {"worker_id": wid, "outcome": OfferOutcome.CANCELLED, "reason": "consumer"},
            )
        )
    finish(state, rs, FinishReason.CANCELLED, now, fx)


def _stop_for_shutdown(state: RouterState, rs: RequestState, now: float, fx: Effects) -> None:
    """End ``rs`` now with a ``shutting_down`` error naming how far it got; cancel it at its worker."""
    rid = rs.request.request_id
    if rs.worker_id is not None:
        wid = rs.worker_id
        fx.append(SendCancel(wid, Cancel(assignment=Assignment(rid, rs.attempt), worker_id=wid, reason="shutdown")))
        fx.append(
            Record(
                RecordKind.OFFER_OUTCOME,
                rid,
                rs.attempt,
                now,
                {"worker_id": wid, "outcome": OfferOutcome.CANCELLED, "reason": "shutdown"},
            )
        )
    state.count("stopped_by_shutdown")
    stopped = RequestError(
        ErrorKind.SHUTTING_DOWN,
        f"kvrelay shut down before the request finished: {len(rs.delivered)} of "
        f"{rs.request.max_new_tokens} tokens were delivered; send it again to continue",
    )
    finish(state, rs, FinishReason.ERROR, now, fx, stopped)


# --- timers and workers ---------------------------------------------------------


def _on_timer(state: RouterState, timer: TimerKey, now: float, fx: Effects) -> None:
    _, rid, attempt = timer
    rs = state.requests.get(rid)
    if rs is None or rs.attempt != attempt or rs.worker_id is None:
        return
    if rs.phase == Phase.OFFERED:
        state.count("offer_timeouts")
        abandon(state, rs, now, fx, OfferOutcome.TIMED_OUT, "offer timed out", send_cancel=True)
    elif rs.phase == Phase.RUNNING:
        grace = state.config.progress_timeout_s
        if rs.first_token_at is None and rs.candidate is not None:
            grace += 2 * rs.candidate.predicted_ttft_s
        deadline = rs.last_progress + grace
        if now >= deadline:
            state.count("progress_timeouts")
            abandon(state, rs, now, fx, OfferOutcome.TIMED_OUT, "no progress after acceptance", send_cancel=True)
        else:
            fx.append(StartTimer((TimerKind.OFFER, rid, attempt), deadline))


def _worker_lost(state: RouterState, wid: str, epoch: int, now: float, fx: Effects, reason: str) -> None:
    """Fence everything of ``wid`` up to ``epoch``: its residency and its assignments."""
    view = state.views.get(wid)
    if view is not None and view.heartbeat.epoch <= epoch:
        del state.views[wid]
        state.roster.remove(wid)
    state.index.drop_worker(wid)
    state.pending.drop_worker(wid)
    state.residency_seq.pop(wid, None)
    for rid in sorted(state.by_worker.get(wid, ())):
        rs = state.requests.get(rid)
        if rs is not None and rs.worker_id == wid and rs.epoch <= epoch:
            state.count("worker_lost_assignments")
            abandon(state, rs, now, fx, OfferOutcome.WORKER_LOST, f"{reason} (epoch {epoch})", send_cancel=False)


# --- worker messages ------------------------------------------------------------


def _on_message(state: RouterState, msg: WireMessage, now: float, fx: Effects) -> None:
    match msg:
        case Heartbeat():
            _on_heartbeat(state, msg, now, fx)
        case Residency():
            _on_residency(state, msg, now, fx)
        case OfferResult() | Delta() | Result():
            on_assignment_message(state, msg, now, fx)
        case Offer() | Cancel() | Fenced():
            state.count("unexpected_message")
        case _:
            assert_never(msg)


def _on_heartbeat(state: RouterState, hb: Heartbeat, now: float, fx: Effects) -> None:
    verdict = accept_heartbeat(state.registry, hb, now)
    if not verdict.accepted:
        state.count("stale_heartbeat")
        if verdict.reason is HeartbeatReason.EPOCH_FENCED:
            # The worker goes on in an epoch the router refuses for good: tell it, so it starts a newer one.
            state.count("fenced_notices")
            reason = f"epoch {hb.epoch} of {hb.worker_id} is fenced; come back in a newer epoch"
            fx.append(SendFenced(hb.worker_id, Fenced(worker_id=hb.worker_id, epoch=hb.epoch, reason=reason[:256])))
        return
    if verdict.replaced_epoch is not None:
        state.count("epoch_replaced")
        _worker_lost(state, hb.worker_id, verdict.replaced_epoch, now, fx, "restarted")
    fps = predicted_ttft.reported_fingerprints(hb)
    for model, fp in fps.items():
        state.fingerprints.setdefault(model, fp)
    view = state.views.get(hb.worker_id)
    if view is None or view.heartbeat.epoch != hb.epoch:
        fx.append(LoadReplicas(hb.worker_id))  # its durable tiers may hold chunks the index forgot or never saw
    load = view.load if view is not None else predicted_ttft.WorkerLoad()
    load.heard()
    load.restore_backlog_s, load.restore_backlog_at = hb.lower_tier_load_s, now
    view = state.views[hb.worker_id] = predicted_ttft.WorkerView(hb, load, fps)
    state.roster.put(view)
    state.wake = True


def _on_residency(state: RouterState, msg: Residency, now: float, fx: Effects) -> None:
    """Follow a worker's residency in the index; durable tiers (ssd, object) also become replica facts.

    A snapshot (``replace``) makes the index list exactly its keys for that worker and tier: what the index held
    beyond them (from before a restart, or from stale replica facts) is removed, and recorded as removed."""
    entry = state.registry.live_entry(msg.worker_id)
    last = state.residency_seq.get(msg.worker_id, (-1, -1))
    if entry is None or msg.epoch != entry.epoch or (msg.epoch, msg.seq) <= last:
        state.count("stale_residency")
        return
    state.residency_seq[msg.worker_id] = (msg.epoch, msg.seq)
    stored, removed = msg.stored, msg.removed
    if msg.replace:
        state.count("residency_snapshots")
        held = state.index.keys_of(msg.worker_id, msg.tier)
        known, now_held = set(held), set(stored)
        stored = tuple(k for k in stored if k not in known)
        removed = tuple(k for k in held if k not in now_held)
    if stored:
        state.index.store(msg.worker_id, msg.tier, stored)
    if msg.stored and msg.tier == "gpu":
        state.pending.settle(msg.worker_id, msg.stored)
    if removed:
        state.index.remove(msg.worker_id, msg.tier, removed)
    if msg.tier in ("ssd", "object") and (stored or removed):
        fx.append(
            Record(
                RecordKind.REPLICA,
                "",
                0,
                now,
                {"worker_id": msg.worker_id, "tier": msg.tier, "stored": stored, "removed": removed},
            )
        )
