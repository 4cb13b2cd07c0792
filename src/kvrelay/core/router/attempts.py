"""The lifecycle of one attempt at the router: route it, hold it in the router queue, end it, or abandon it.

Pure functions over ``RouterState``, used by ``router.step``. Invariants:
an attempt holds router-side load on its worker (``WorkerLoad``) exactly
until ``release``; ``route`` either sends one offer (attempt + 1) with its
offer timer and its decision record, holds the request in the router queue
(``router.queue``; a new request may be refused there), or ends it with one
``DeliverResult`` through ``finish``. ``dispatch`` sends the queue's head on
while it can go. A request that fits some worker's KV when that worker is idle
never fails for load: it waits.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from kvrelay.core.planning import candidates as cand
from kvrelay.core.planning import exclusions, predicted_ttft
from kvrelay.core.planning.predicted_ttft import Candidate, WorkerView
from kvrelay.core.planning.roster import plan_pruned
from kvrelay.core.planning.routes import offered_route
from kvrelay.core.policies.base import RoutingContext
from kvrelay.core.router import reuse
from kvrelay.core.router.events import (
    CancelTimer,
    DeliverResult,
    Effect,
    ErrorKind,
    OfferOutcome,
    Outcome,
    Record,
    RecordKind,
    RequestError,
    SendCancel,
    SendOffer,
    StartTimer,
    TimerKind,
)
from kvrelay.core.router.offered_load import OfferedLoad, long_backlog
from kvrelay.core.router.queue import RouterQueue
from kvrelay.core.router.servable import unservable
from kvrelay.core.router.state import Phase, RequestState, RouterState, usage_of
from kvrelay.protocol.chunk_keys import cacheable_chunks, prompt_chain
from kvrelay.protocol.messages import (
    Assignment,
    Cancel,
    FinishReason,
    Offer,
    RouteSegment,
)

Effects = list[Effect]


def route(state: RouterState, rs: RequestState, now: float, fx: Effects) -> bool:
    """Offer the request's next attempt, hold it in the router queue, or end it; False while it waits.

    A new request waits behind those already waiting; any request waits while no worker it could go
    to can start it within ``Limits.start_within_s`` or none has room for it (``router.queue``).
    """
    request, config = rs.request, state.config
    remaining = request.max_new_tokens - len(rs.delivered)
    if remaining <= 0:
        finish(state, rs, FinishReason.LENGTH, now, fx)
        return True
    if rs.attempt >= config.max_attempts:
        gave_up = f"gave up after {rs.attempt} attempts: {'; '.join(rs.reasons[-3:])}"
        finish(state, rs, FinishReason.ERROR, now, fx, RequestError(ErrorKind.GAVE_UP, gave_up))
        return True
    prompt = request.prompt + tuple(rs.delivered) if rs.delivered else request.prompt
    if request.chain is not None:
        chain = request.chain[: cacheable_chunks(len(prompt), config.chunk_tokens)]
    else:
        chain = prompt_chain(rs.fingerprint, prompt, config.chunk_tokens)
    policy, busy = state.policy, state.roster.busy_share()
    predicts = policy.predicts_on_route and config.predict_on_route
    weight = policy.work_weight * busy
    scoring = predicted_ttft.Scoring(
        weight, busy < policy.interleave_below_busy_share, predicts, state.roster.work_s_per_token() if weight else 0.0
    )
    if policy.needs_all_routes:
        plan = cand.plan(
            request.model,
            len(prompt),
            remaining,
            chain,
            rs.fingerprint,
            config.chunk_tokens,
            list(state.views.values()),
            state.index,
            rs.excluded_workers,
            rs.excluded_pairs,
            now,
            scoring,
        )
    else:
        plan = plan_pruned(
            request.model,
            len(prompt),
            remaining,
            chain,
            rs.fingerprint,
            config.chunk_tokens,
            state.roster,
            state.index,
            rs.excluded_workers,
            rs.excluded_pairs,
            now,
            scoring,
        )
    new = rs.attempt == 0 and rs.phase is not Phase.QUEUED
    work = _work_s(state, request.model, plan, len(prompt))
    if new:  # count its work as offered (``router.offered_load``)
        state.offered[request.model] = state.offered.get(request.model, OfferedLoad()).arrived(now, work)
    behind = new and bool(state.queues.get(request.model))
    if plan.routes and not behind and _can_start(state, rs, plan, len(prompt) + remaining):
        ctx = RoutingContext(
            request, prompt, chain, config.chunk_tokens, plan, state.views, state.rng, now, rs.arrived, busy
        )
        chosen = policy.choose(ctx)
        if chosen is not None:
            _offer(state, rs, ctx, chosen, predicts, now, fx)
            return True
    if not plan.routes and (error := unservable(state, rs, plan, len(prompt), remaining, now)) is not None:
        finish(state, rs, FinishReason.ERROR, now, fx, error)
        return True
    _hold(state, rs, work, now, fx)
    return rs.phase is Phase.DONE


def _offer(
    state: RouterState,
    rs: RequestState,
    ctx: RoutingContext,
    chosen: Candidate,
    predicts: bool,
    now: float,
    fx: Effects,
) -> None:
    """Send the offer of ``chosen``: attempt + 1, its router-side load, its offer timer and decision record."""
    request, config, plan, prompt, chain = rs.request, state.config, ctx.plan, ctx.prompt, ctx.chain
    remaining = request.max_new_tokens - len(rs.delivered)
    state.policy.on_routed(ctx, chosen)
    view = state.views[chosen.worker_id]
    chosen_route = next(r for r in plan.routes if r.worker_id == chosen.worker_id)
    alternatives = cand.alternative_routes(chosen_route, view, len(prompt), remaining, now)
    if rs.phase is Phase.QUEUED:
        state.queues[request.model].take(request.request_id)
        rs.queued_since = None
    rs.attempt += 1
    rs.phase, rs.worker_id, rs.epoch, rs.candidate = Phase.OFFERED, chosen.worker_id, chosen.epoch, chosen
    rs.attempt_start, rs.next_seq, rs.pending = len(rs.delivered), 0, {}
    rs.last_progress = now
    offered = offered_route(chosen.route)
    gpu = sum(s.chunks for s in offered if s.tier == "gpu") * config.chunk_tokens
    rs.demand_pages = predicted_ttft.page_demand(len(prompt), remaining, gpu, view.heartbeat.page_tokens)
    rs.chain, rs.gpu_tokens = chain, gpu
    priority = state.policy.priority(ctx, chosen)
    first = state.pending.first_priority_on_route(chosen.worker_id, chosen.route, chain)
    priority = priority if first is None else max(priority, first)  # never ahead of the request it relies on
    if predicts:
        deadline = now + config.pending_timeout_s + 2 * chosen.predicted_ttft_s
        state.pending.credit(chosen.worker_id, request.request_id, chain, deadline, priority)
    restore_s = sum(chosen.terms.restore_s.values())
    rs.estimate_s = restore_s + chosen.terms.prefill_s  # the forward that samples the first token is in the queue's
    load = view.load
    load.offered(rs.estimate_s)
    load.active += 1
    rs.accepted_at = None
    state.roster.requeue(view)
    if restore_s:
        load.restore_backlog_s = predicted_ttft.lower_load_of(view, now) + restore_s
        load.restore_backlog_at = now
    load.inflight_pages += rs.demand_pages
    rs.holds_outstanding = rs.holds_inflight = True
    state.by_worker.setdefault(chosen.worker_id, set()).add(request.request_id)
    assignment = Assignment(request.request_id, rs.attempt)
    fx.append(
        SendOffer(
            chosen.worker_id,
            Offer(
                assignment=assignment,
                worker_id=chosen.worker_id,
                epoch=chosen.epoch,
                model=request.model,
                model_fingerprint=rs.fingerprint.hex(),
                prompt=prompt,
                max_new_tokens=remaining,
                generated_before=len(rs.delivered),
                sampling=request.sampling,
                route=_peer_urls(state, offered),
                chain=chain[: sum(s.chunks for s in offered)],
                priority=priority,
                traceparent=request.traceparent,
            ),
        )
    )
    fx.append(StartTimer((TimerKind.OFFER, request.request_id, rs.attempt), now + config.offer_timeout_s))
    fx.append(
        Record(
            RecordKind.DECISION,
            request.request_id,
            rs.attempt,
            now,
            {
                "policy": state.policy.name,
                "model": request.model,
                "chosen": chosen,
                "candidates": (*plan.routes, *alternatives[1:]),
                "excluded": exclusions.texts(plan.excluded),
                "pruned": plan.pruned,
            },
        )
    )
    state.count("offers")
    state.count(reuse.AVAILABLE, plan.available_chunks * config.chunk_tokens)
    state.count(reuse.CAPTURED, chosen.cached_tokens)
    if rs.attempt > 1:
        state.count("retries")


def _can_start(state: RouterState, rs: RequestState, plan: cand.Plan, need: int) -> bool:
    """Whether some worker the request could go to would start it within the queue's start bound."""
    bound = state.config.queue.start_within_s
    if bound == math.inf or any(r.base_queue_s <= bound for r in plan.routes):
        return True
    return state.roster.least_queue(rs.request.model, need, plan.excluded.keys() | rs.excluded_workers) <= bound


def _hold(state: RouterState, rs: RequestState, work: float, now: float, fx: Effects) -> None:
    """Keep the request in the router queue: admit a new one (or refuse it), put one that came back in front;
    ``work``: its predicted prefill seconds (``_work_s``)."""
    request = rs.request
    rid = request.request_id
    queue = state.queues.setdefault(request.model, RouterQueue())
    if rid in queue:
        return
    if rs.attempt == 0:
        order = state.policy.hold_order(rs.arrived, work)
        serving = sum(1 for _ in _serving(state, request.model))
        refusal = queue.admit(state.config.queue, rid, request.priority, request.user, work, order, serving)
        if refusal is not None:
            state.count("queue_refused")
            full = RequestError(ErrorKind.QUEUE_FULL, refusal.reason, refusal.retry_after_s)
            finish(state, rs, FinishReason.ERROR, now, fx, full)
            return
    else:
        queue.requeue(rid, request.priority, request.user, work)
    rs.phase, rs.queued_since = Phase.QUEUED, now
    state.count("queued")


def _serving(state: RouterState, model: str) -> Iterator[WorkerView]:
    return (v for v in state.views.values() if model in v.heartbeat.models)


def _work_s(state: RouterState, model: str, plan: cand.Plan, prompt_len: int) -> float:
    """A request's predicted prefill seconds for the router queue: its tokens no planned route holds, at the
    fastest serving worker's rate."""
    rate = min((v.heartbeat.prefill_s_per_token for v in _serving(state, model)), default=0.0)
    return (prompt_len - max((r.cached_tokens for r in plan.routes), default=0)) * rate


def dispatch(state: RouterState, now: float, fx: Effects) -> None:
    """Send each model's waiting requests on, the head first, while its head can go (``router.queue``), in the
    order its backlog and offered load call for (``router.offered_load``)."""
    state.wake = False
    for model, queue in list(state.queues.items()):
        rates = (v.heartbeat.prefill_s_per_token for v in _serving(state, model))
        queue.long_backlog = long_backlog(state.offered.get(model, OfferedLoad()), now, queue.work_s, rates)
        going = True
        while going and (rid := queue.head()) is not None:
            going = route(state, state.requests[rid], now, fx)
        if not queue:
            del state.queues[model]


def release(state: RouterState, rs: RequestState) -> None:
    """Return the router-side load the current attempt holds on its worker."""
    wid = rs.worker_id
    if wid is None:
        return
    view = state.views.get(wid)
    if view is not None:
        load = view.load
        if rs.holds_outstanding:
            release_estimate(load, rs)
        if rs.holds_inflight:
            load.inflight_pages = max(0, load.inflight_pages - rs.demand_pages)
        if rs.pages_accepted_at is not None:
            load.pages_released(_freed_pages(state, rs, wid, view.heartbeat.page_tokens), rs.pages_accepted_at)
        load.active = max(0, load.active - 1)
        state.roster.requeue(view)  # ``queue_of`` counts the outstanding estimates and the requests in flight
    rs.holds_outstanding = rs.holds_inflight = False
    rs.pages_accepted_at = None
    state.by_worker.get(wid, set()).discard(rs.request.request_id)
    state.pending.release(rs.request.request_id)
    rs.worker_id = None


def _freed_pages(state: RouterState, rs: RequestState, wid: str, page_tokens: int) -> int:
    """The pages of ``rs``'s demand its end frees on ``wid``: less those of the chunks it computed that another
    request there still holds (a follower that took them as its prefix, from the device or as they were
    computed: the worker shares a computed chunk, and a follower's own reservation stays whole)."""
    shared = 0
    for other_id in state.by_worker.get(wid, ()):
        other = state.requests.get(other_id)
        if other is not None and other is not rs and other.worker_id == wid:
            shared = max(shared, _common_chunks(other.chain, rs.chain))
    held = max(0, shared * state.config.chunk_tokens - rs.gpu_tokens) // page_tokens
    return max(0, rs.demand_pages - held)


def _common_chunks(a: tuple[bytes, ...], b: tuple[bytes, ...]) -> int:
    """Leading chunks two chains share; a chain key commits to its whole prefix, so a bisection finds it."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def release_estimate(load: predicted_ttft.WorkerLoad, rs: RequestState) -> None:
    """Take the attempt's estimate out of its worker's outstanding and unheard work (``WorkerLoad``)."""
    load.release_outstanding(rs.estimate_s)
    load.unheard_released(rs.estimate_s, rs.accepted_at)


def abandon(
    state: RouterState,
    rs: RequestState,
    now: float,
    fx: Effects,
    outcome: OfferOutcome,
    reason: str,
    send_cancel: bool,
    exclude: tuple[str, str] | None = None,
) -> None:
    """End the current attempt (cancel it at the worker if asked) and route the next one."""
    wid = rs.worker_id
    assert wid is not None
    fx.append(CancelTimer((TimerKind.OFFER, rs.request.request_id, rs.attempt)))
    if send_cancel:
        fx.append(
            SendCancel(
                wid,
                Cancel(assignment=Assignment(rs.request.request_id, rs.attempt), worker_id=wid, reason=reason[:200]),
            )
        )
    fx.append(
        Record(
            RecordKind.OFFER_OUTCOME,
            rs.request.request_id,
            rs.attempt,
            now,
            {"worker_id": wid, "outcome": outcome, "reason": reason},
        )
    )
    if exclude is not None:
        rs.excluded_pairs.add(exclude)
    else:
        rs.excluded_workers.add(wid)
    rs.reasons.append(f"{wid}: {reason}")
    release(state, rs)
    rs.phase = Phase.NEW
    route(state, rs, now, fx)


def finish(
    state: RouterState,
    rs: RequestState,
    reason: FinishReason,
    now: float,
    fx: Effects,
    failure: RequestError | None = None,
) -> None:
    rid = rs.request.request_id
    if rs.worker_id is not None:
        fx.append(CancelTimer((TimerKind.OFFER, rid, rs.attempt)))
        release(state, rs)
        state.wake = True  # its worker has room for another
    rs.phase = Phase.DONE
    state.requests.pop(rid, None)
    if (queue := state.queues.get(rs.request.model)) is not None:
        queue.remove(rid)
    ttft = None if rs.first_token_at is None else rs.first_token_at - rs.arrived
    usage = usage_of(rs)
    outcome = Outcome(rid, reason, tuple(rs.delivered), rs.attempt, usage, ttft, failure)
    fx.append(DeliverResult(rid, outcome))
    fx.append(
        Record(
            RecordKind.OUTCOME,
            rid,
            rs.attempt,
            now,
            {
                "finish_reason": reason,
                "ttft_s": ttft,
                "inter_token_s": [],
                "cached_tokens": usage.cached_tokens,
                "recomputed_tokens": usage.recomputed_tokens,
                "generated_tokens": usage.generated_tokens,
                "bytes_by_tier": {},
                "attempts": rs.attempt,
                "error": outcome.error,
            },
        )
    )
    state.count(f"finished_{reason}")


def _peer_urls(state: RouterState, route: tuple[RouteSegment, ...]) -> tuple[RouteSegment, ...]:
    """Name each peer segment's source by the URL its worker serves chunks on (its id when it has none)."""
    out = []
    for seg in route:
        view = state.views.get(seg.source) if seg.tier == "peer" else None
        out.append(
            RouteSegment(seg.tier, seg.chunks, view.heartbeat.peer_url) if view and view.heartbeat.peer_url else seg
        )
    return tuple(out)
