"""The lifecycle of one attempt at the router: route it, park it, end it, or abandon it for the next.

Pure functions over ``RouterState``, used by ``router.step``. Invariants:
an attempt holds router-side load on its worker (``WorkerLoad``) exactly
until ``release``; ``route`` either sends one offer (attempt + 1) with its
offer timer and its decision record, parks the request for capacity, or ends
it with one ``DeliverResult`` through ``finish``.
"""

from __future__ import annotations

from kvrelay.core.planning import candidates as cand
from kvrelay.core.planning import exclusions, predicted_ttft
from kvrelay.core.planning.exclusions import ExclusionKind
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


def route(state: RouterState, rs: RequestState, now: float, fx: Effects) -> None:
    """Offer the request's next attempt to the best candidate, park it, or end it."""
    request, config = rs.request, state.config
    remaining = request.max_new_tokens - len(rs.delivered)
    if remaining <= 0:
        finish(state, rs, FinishReason.LENGTH, now, fx)
        return
    if rs.attempt >= config.max_attempts:
        gave_up = f"gave up after {rs.attempt} attempts: {'; '.join(rs.reasons[-3:])}"
        finish(state, rs, FinishReason.ERROR, now, fx, RequestError(ErrorKind.GAVE_UP, gave_up))
        return
    prompt = request.prompt + tuple(rs.delivered) if rs.delivered else request.prompt
    if request.chain is not None:
        chain = request.chain[: cacheable_chunks(len(prompt), config.chunk_tokens)]
    else:
        chain = prompt_chain(rs.fingerprint, prompt, config.chunk_tokens)
    policy, busy = state.policy, state.roster.busy_share()
    predicts = policy.predicts_on_route and config.predict_on_route
    scoring = predicted_ttft.Scoring(policy.work_weight * busy, busy < policy.interleave_below_busy_share, predicts)
    if state.policy.needs_all_routes:
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
    ctx = RoutingContext(request, prompt, chain, config.chunk_tokens, plan, state.views, state.rng, now, rs.arrived)
    chosen = state.policy.choose(ctx) if plan.routes else None
    if chosen is None:
        no_candidate(state, rs, plan, now, fx)
        return
    state.policy.on_routed(ctx, chosen)
    view = state.views[chosen.worker_id]
    chosen_route = next(r for r in plan.routes if r.worker_id == chosen.worker_id)
    alternatives = cand.alternative_routes(chosen_route, view, len(prompt), remaining, now)
    rs.attempt += 1
    rs.phase, rs.worker_id, rs.epoch, rs.candidate = Phase.OFFERED, chosen.worker_id, chosen.epoch, chosen
    rs.attempt_start, rs.next_seq, rs.pending = len(rs.delivered), 0, {}
    rs.last_progress = now
    if rs.parked_since is not None:
        state.parked.pop(request.request_id, None)
        rs.parked_since = None
    offered = offered_route(chosen.route)
    gpu = sum(s.chunks for s in offered if s.tier == "gpu") * config.chunk_tokens
    rs.demand_pages = predicted_ttft.page_demand(len(prompt), remaining, gpu, view.heartbeat.page_tokens)
    if predicts:
        deadline = now + config.pending_timeout_s + 2 * chosen.predicted_ttft_s
        state.pending.credit(chosen.worker_id, request.request_id, chain, deadline)
    rs.estimate_s = chosen.predicted_ttft_s - chosen.terms.queue_s
    load = view.load
    load.outstanding_s += rs.estimate_s
    state.roster.requeue(view)
    restore_s = sum(chosen.terms.restore_s.values())
    if restore_s:
        load.restore_backlog_s = predicted_ttft.lower_load_of(view, now) + restore_s
        load.restore_backlog_at = now
    load.inflight_pages += rs.demand_pages
    load.active += 1
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
                priority=state.policy.priority(ctx, chosen),
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


def no_candidate(state: RouterState, rs: RequestState, plan: cand.Plan, now: float, fx: Effects) -> None:
    """No candidate for the request: end it (model not served, context too long, waited too long) or park it.

    A new request for a model no live worker serves ends at once; one that was offered before parks, since
    the worker that served it may come back (a new epoch, a restart)."""
    model = rs.request.model
    serving = [w for w, v in state.views.items() if model in v.heartbeat.models]
    if not serving and rs.attempt == 0:
        served = sorted({m for v in state.views.values() for m in v.heartbeat.models})
        finish(
            state,
            rs,
            FinishReason.ERROR,
            now,
            fx,
            RequestError(
                ErrorKind.NO_WORKER, f"model '{model}' is not served; served models: {', '.join(served) or 'none'}"
            ),
        )
        return
    # A request some worker took before waits (parked, within max_queue_wait_s) for a server of its model to
    # come back, e.g. a worker back in a new epoch after its old one was fenced, or a restarted worker.
    if serving and _all_excluded(plan, serving, ExclusionKind.CONTEXT_LIMIT):
        limit = RequestError(ErrorKind.OVER_CONTEXT_LIMIT, plan.excluded[serving[0]].text)
        finish(state, rs, FinishReason.ERROR, now, fx, limit)
        return
    if _all_excluded(plan, serving, ExclusionKind.FAILED_BEFORE):
        # Every server of the model failed this request once: forget the exclusions
        # and wait for fresh heartbeats rather than fail while attempts remain.
        rs.excluded_workers.clear()
        rs.excluded_pairs.clear()
    if rs.parked_since is None:
        rs.parked_since = now
        state.count("parked")
    elif now - rs.parked_since > state.config.max_queue_wait_s:
        state.parked.pop(rs.request.request_id, None)
        if serving:
            waited = RequestError(ErrorKind.NO_CAPACITY, f"waited {now - rs.parked_since:.1f} s for a worker")
        else:
            waited = RequestError(
                ErrorKind.NO_WORKER,
                f"waited {now - rs.parked_since:.1f} s for a worker serving model '{model}' to come back; none did",
            )
        finish(state, rs, FinishReason.ERROR, now, fx, waited)
        return
    rs.phase = Phase.PARKED
    state.parked[rs.request.request_id] = None


def _all_excluded(plan: cand.Plan, workers: list[str], kind: ExclusionKind) -> bool:
    """Whether planning excluded every one of ``workers`` for ``kind``."""
    return all((e := plan.excluded.get(w)) is not None and e.kind is kind for w in workers)


def retry_parked(state: RouterState, now: float, fx: Effects) -> None:
    for rid in list(state.parked):
        rs = state.requests.get(rid)
        if rs is None or rs.phase != Phase.PARKED:
            state.parked.pop(rid, None)
            continue
        route(state, rs, now, fx)


def release(state: RouterState, rs: RequestState) -> None:
    """Return the router-side load the current attempt holds on its worker."""
    wid = rs.worker_id
    if wid is None:
        return
    view = state.views.get(wid)
    if view is not None:
        load = view.load
        if rs.holds_outstanding:
            load.release_outstanding(rs.estimate_s)
            state.roster.requeue(view)
        if rs.holds_inflight:
            load.inflight_pages = max(0, load.inflight_pages - rs.demand_pages)
        load.active = max(0, load.active - 1)
    rs.holds_outstanding = rs.holds_inflight = False
    state.by_worker.get(wid, set()).discard(rs.request.request_id)
    state.pending.release(rs.request.request_id)
    rs.worker_id = None


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
    rs.phase = Phase.DONE
    state.requests.pop(rid, None)
    state.parked.pop(rid, None)
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
