"""What the router machine does with a worker's messages about one attempt: ``OfferResult``, ``Delta``, ``Result``.

``on_assignment_message`` handles a message only if its assignment is the request's current attempt on the
worker holding it; anything else is stale, dropped and counted, and a stale acceptance is answered with a cancel
(docs/design.md section 3). An acceptance starts the attempt (or a decline re-routes it), deltas reach the
consumer once and in order (a first delta accepts an offer whose acceptance was lost), and a result ends the
request or continues it on another attempt. ``core.router.machine`` dispatches to it.
"""

from __future__ import annotations

from typing import assert_never

from kvrelay.core.router import reuse
from kvrelay.core.router.attempts import (
    abandon,
    finish,
    release_estimate,
)
from kvrelay.core.router.events import (
    CancelTimer,
    DeliverDelta,
    Effect,
    OfferOutcome,
    Record,
    RecordKind,
    SendCancel,
    StartTimer,
    TimerKind,
)
from kvrelay.core.router.state import (
    Phase,
    RequestState,
    RouterState,
)
from kvrelay.protocol.messages import (
    Cancel,
    DeclineReason,
    Delta,
    FinishReason,
    OfferResult,
    Result,
)

Effects = list[Effect]


def on_assignment_message(state: RouterState, msg: OfferResult | Delta | Result, now: float, fx: Effects) -> None:
    """A message about one attempt: handled if it is the request's current one, else dropped as stale."""
    rs = state.requests.get(msg.assignment.request_id)
    if rs is None or rs.attempt != msg.assignment.attempt or rs.worker_id != msg.worker_id:
        state.count("stale_dropped")
        if isinstance(msg, OfferResult) and msg.accepted:
            state.count("stale_accept_cancelled")
            fx.append(
                SendCancel(
                    msg.worker_id, Cancel(assignment=msg.assignment, worker_id=msg.worker_id, reason="stale assignment")
                )
            )
        return
    match msg:
        case OfferResult():
            _on_offer_result(state, rs, msg, now, fx)
        case Delta():
            _on_delta(state, rs, msg, now, fx)
        case Result():
            _on_result(state, rs, msg, now, fx)
        case _:
            assert_never(msg)


def _on_offer_result(state: RouterState, rs: RequestState, msg: OfferResult, now: float, fx: Effects) -> None:
    if rs.phase != Phase.OFFERED:
        state.count("duplicate_offer_result")
        return
    view = state.views.get(msg.worker_id)
    if rs.holds_inflight and view is not None:
        view.load.inflight_pages = max(0, view.load.inflight_pages - rs.demand_pages)
        if msg.accepted:
            rs.pages_accepted_at = view.load.pages_accepted(rs.demand_pages)
    if msg.accepted and rs.holds_outstanding and view is not None:
        rs.accepted_at = view.load.accepted(rs.estimate_s)
    rs.holds_inflight = False
    if msg.accepted:
        state.count("accepted")
        rs.phase = Phase.RUNNING
        fx.append(CancelTimer((TimerKind.OFFER, rs.request.request_id, rs.attempt)))
        fx.append(
            StartTimer((TimerKind.OFFER, rs.request.request_id, rs.attempt), now + state.config.progress_timeout_s)
        )
        fx.append(
            Record(
                RecordKind.OFFER_OUTCOME,
                rs.request.request_id,
                rs.attempt,
                now,
                {"worker_id": msg.worker_id, "outcome": OfferOutcome.ACCEPTED, "reason": None},
            )
        )
        return
    state.count("declines")
    state.count(f"declined_{msg.reason}")
    route_tiers = rs.candidate.tiers if rs.candidate is not None else frozenset()
    exclude = None
    if msg.reason in (DeclineReason.STALE_ROUTE, DeclineReason.NO_CAPACITY) and "gpu" in route_tiers:
        exclude = (msg.worker_id, "gpu")
    reason = f"declined: {msg.reason}" + (f" ({msg.detail})" if msg.detail else "")
    abandon(state, rs, now, fx, OfferOutcome.DECLINED, reason, send_cancel=False, exclude=exclude)


def _deliver(state: RouterState, rs: RequestState, tokens: tuple[int, ...], now: float, fx: Effects) -> None:
    room = rs.request.max_new_tokens - len(rs.delivered)
    tokens = tokens[:room]
    if not tokens:
        return
    if rs.first_token_at is None:
        rs.first_token_at = now
    fx.append(DeliverDelta(rs.request.request_id, len(rs.delivered), tokens))
    rs.delivered.extend(tokens)


def _first_progress(state: RouterState, rs: RequestState) -> None:
    if rs.holds_outstanding:
        view = state.views.get(rs.worker_id or "")
        if view is not None:
            release_estimate(view.load, rs)
            state.roster.requeue(view)
        rs.holds_outstanding = False
        state.wake = True


def _on_delta(state: RouterState, rs: RequestState, msg: Delta, now: float, fx: Effects) -> None:
    if rs.phase == Phase.OFFERED:  # the acceptance was lost or overtaken; the delta proves it
        rs.phase = Phase.RUNNING
        _mark_accepted_implicitly(state, rs, msg.worker_id, now, fx)
    rs.last_progress = now
    _first_progress(state, rs)
    if msg.seq < rs.next_seq or msg.seq in rs.pending:
        state.count("duplicate_dropped")
        return
    rs.pending[msg.seq] = msg.tokens
    while rs.next_seq in rs.pending:
        _deliver(state, rs, rs.pending.pop(rs.next_seq), now, fx)
        rs.next_seq += 1


def _mark_accepted_implicitly(state: RouterState, rs: RequestState, wid: str, now: float, fx: Effects) -> None:
    view = state.views.get(wid)
    if rs.holds_inflight and view is not None:
        view.load.inflight_pages = max(0, view.load.inflight_pages - rs.demand_pages)
    rs.holds_inflight = False
    fx.append(CancelTimer((TimerKind.OFFER, rs.request.request_id, rs.attempt)))
    fx.append(StartTimer((TimerKind.OFFER, rs.request.request_id, rs.attempt), now + state.config.progress_timeout_s))


def _on_result(state: RouterState, rs: RequestState, msg: Result, now: float, fx: Effects) -> None:
    if rs.phase == Phase.OFFERED:
        _mark_accepted_implicitly(state, rs, msg.worker_id, now, fx)
    _first_progress(state, rs)
    already = len(rs.delivered) - rs.attempt_start
    if tuple(rs.delivered[rs.attempt_start :]) != tuple(msg.tokens[:already]):
        state.count("result_mismatch")
    _deliver(state, rs, tuple(msg.tokens[already:]), now, fx)
    for tier, n in msg.usage.cached_tokens.items():
        rs.cached_tokens[tier] = rs.cached_tokens.get(tier, 0) + n
    state.count(reuse.DELIVERED, sum(msg.usage.cached_tokens.values()))
    rs.recomputed_tokens += msg.usage.recomputed_tokens
    if msg.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
        finish(state, rs, msg.finish_reason, now, fx)
        return
    state.count(f"worker_{msg.finish_reason}")
    abandon(
        state,
        rs,
        now,
        fx,
        OfferOutcome.WORKER_LOST,
        f"worker ended the attempt: {msg.finish_reason} {msg.error or ''}",
        send_cancel=False,
    )
