"""The status page's JSON: the cluster now (``cluster_state``) and one request in full (``request_detail``).

Contract (plain JSON-ready dicts; times in seconds, ``*_ms`` in milliseconds):
- ``cluster_state(state, tap, recent)``: ``now`` (wall clock); ``workers``: per
  live worker (by id) its epoch, models, pages (total, free, evictable, reserved,
  used), queue (the worker's reported queue delay and the requests the router has
  on it), lanes (active, max), bytes held per tier, restore rates per tier
  (bytes/s), and the age of its last heartbeat; ``hits``: over ended requests,
  prompt tokens, tokens served from cache and the infinite-cache bound, with
  their shares; ``reuse``: the router's cumulative reuse figures
  (``core.router.reuse``: available, captured, delivered tokens, as ``/cluster``
  and ``/metrics`` have them); ``ttft``: count, p50, p90, p99 and max over the tap's window;
  ``requests``: the ``recent`` latest requests, newest first, each with its
  decisions (``decision_view``) and its end.
- ``decision_view``: one recorded scoring: its candidates ordered by predicted
  TTFT, each with its route, cached tokens, predicted TTFT, terms, whether it won
  and why it lost (``facts.explain.why_lost``, what ``kvrelay explain`` says),
  the excluded workers and the offer's fate.
- ``request_detail(tap, request_id)``: the request's timeline (marks ordered by
  time, then in the order the router emitted them, with offsets from its
  arrival; each attempt's first token and deltas),
  its decisions, and ``explain``: the lines ``kvrelay explain`` prints for it
  (``facts.explain.explain_lines``, from the same records the store gets); None
  for a request the tap no longer holds. ``stored_detail(history)``: such a
  request from the fact store, in the same shape, without a timeline.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvrelay.core.router.events import Outcome, Record
from kvrelay.core.router.reuse import reuse_figures
from kvrelay.core.router.state import RouterState
from kvrelay.dashboard.tap import ClusterTap, DeltaRun, Mark, MarkKind, Trail
from kvrelay.facts.explain import explain_lines, format_route, format_terms, offer_text, why_lost
from kvrelay.facts.queries import DecisionRow, RequestHistory
from kvrelay.protocol.messages import CACHE_TIERS, Offer, Result

QUANTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))


def _quantile(ordered: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of a non-empty ascending list."""
    rank = max(1, -(-len(ordered) * q // 1))
    return ordered[int(rank) - 1]


def _share(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def _workers(state: RouterState, tap: ClusterTap, now: float) -> dict[str, Any]:
    out = {}
    for wid, view in sorted(state.views.items()):
        hb = view.heartbeat
        seen = tap.heartbeat_at.get(wid)
        out[wid] = {
            "epoch": hb.epoch,
            "models": list(hb.models),
            "pages_total": hb.pages_total,
            "pages_free": hb.pages_free,
            "pages_used": hb.pages_total - hb.pages_free,
            "pages_evictable": hb.pages_evictable,
            "pages_reserved": hb.pages_reserved,
            "queue_delay_s": hb.queue_delay_s,
            "requests_routed": len(state.by_worker.get(wid, ())),
            "active_lanes": hb.active_lanes,
            "max_lanes": hb.max_lanes,
            "bytes_by_tier": dict(hb.chunk_bytes_by_tier),
            "restore_bytes_per_s": dict(hb.restore_bytes_per_s),
            "heartbeat_age_s": None if seen is None else max(0.0, now - seen),
        }
    return out


def decision_view(decision: DecisionRow) -> dict[str, Any]:
    """One scoring as the page shows it (see the module contract)."""
    winner = decision.chosen
    candidates = []
    for c in sorted(decision.candidates, key=lambda c: c["predicted_ttft_s"]):
        won = c == winner
        candidates.append(
            {
                "worker_id": c["worker_id"],
                "route": format_route(c["route"]),
                "cached_tokens": c["cached_tokens"],
                "predicted_ttft_ms": c["predicted_ttft_s"] * 1000,
                "terms": format_terms(c["terms"]),
                "winner": won,
                "lost_because": None if won or winner is None else why_lost(c, winner, decision.policy),
            }
        )
    return {
        "attempt": decision.attempt,
        "time": decision.time,
        "policy": decision.policy,
        "model": decision.model,
        "winner": decision.chosen_worker,
        "winner_route": None if winner is None else format_route(winner["route"]),
        "predicted_ttft_ms": None if decision.predicted_ttft_s is None else decision.predicted_ttft_s * 1000,
        "candidates": candidates,
        "excluded": dict(sorted(decision.excluded.items())),
        "offer": offer_text(decision),
    }


def _request_summary(tap: ClusterTap, trail: Trail) -> dict[str, Any]:
    history = trail.history()
    decisions = [] if history is None else [decision_view(d) for d in history.decisions]
    outcome = trail.outcome
    return {
        "request_id": trail.request_id,
        "model": trail.model,
        "arrived": trail.arrived_wall,
        "prompt_tokens": trail.prompt_tokens,
        "bound_tokens": trail.bound_tokens,
        "decisions": decisions,
        "finish_reason": None if outcome is None else str(outcome.finish_reason),
        "attempts": None if outcome is None else outcome.attempts,
        "ttft_ms": None if outcome is None or outcome.ttft_s is None else outcome.ttft_s * 1000,
        "cached_tokens": None
        if outcome is None
        else sum(n for tier, n in outcome.usage.cached_tokens.items() if tier in CACHE_TIERS),
        "generated_tokens": None if outcome is None else len(outcome.tokens),
        "error": None if outcome is None else outcome.error,
    }


def cluster_state(state: RouterState, tap: ClusterTap, recent: int = 40) -> dict[str, Any]:
    """The cluster now (see the module contract)."""
    now = tap.clock()
    totals = tap.totals
    ttfts = sorted(tap.recent_ttfts(now))
    ttft: dict[str, Any] = {"window_s": tap.ttft_window_s, "count": len(ttfts)}
    for name, q in QUANTILES:
        ttft[f"{name}_ms"] = _quantile(ttfts, q) * 1000 if ttfts else None
    ttft["max_ms"] = ttfts[-1] * 1000 if ttfts else None
    trails = list(tap.trails.values())[-recent:]
    return {
        "now": tap.wall(),
        "policy": state.policy.name,
        "workers": _workers(state, tap, now),
        "in_flight": len(state.requests),
        "hits": {
            "requests": totals.requests,
            "prompt_tokens": totals.prompt_tokens,
            "cached_tokens": totals.cached_tokens,
            "bound_tokens": totals.bound_tokens,
            "hit_share": _share(totals.cached_tokens, totals.prompt_tokens),
            "bound_share": _share(totals.bound_tokens, totals.prompt_tokens),
            "captured_of_bound": _share(totals.cached_tokens, totals.bound_tokens),
        },
        "reuse": reuse_figures(state.counters).as_dict(),
        "ttft": ttft,
        "requests": [_request_summary(tap, t) for t in reversed(trails)],
    }


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def describe(mark: Mark, trail: Trail) -> str:
    """What happened at ``mark``, in words."""
    subject = mark.subject
    match mark.kind, subject:
        case MarkKind.ARRIVED, _:
            return f"arrived: {trail.prompt_tokens} prompt tokens, model {trail.model}"
        case MarkKind.OFFERED, Offer():
            route = format_route(msgspec.to_builtins(subject.route))
            return f"offered to {mark.worker_id} (epoch {subject.epoch}): {route}"
        case MarkKind.RESTORE, Result(timings=timings, usage=usage):
            cached = ", ".join(f"{tier} {n}" for tier, n in sorted(usage.cached_tokens.items()) if n) or "none"
            return (
                f"restore on {mark.worker_id}: {_ms(timings.restore_s)} (cached {cached}; recomputed "
                f"{usage.recomputed_tokens}); queue {_ms(timings.queue_s)}, prefill {_ms(timings.prefill_s)}, "
                f"worker TTFT {_ms(timings.ttft_s)}"
            )
        case MarkKind.FIRST_TOKEN, _:
            return f"first token from {mark.worker_id}"
        case MarkKind.DELTAS, DeltaRun(messages=messages, tokens=tokens):
            return f"{messages} delta message(s), {tokens} token(s) from {mark.worker_id}, the last one here"
        case MarkKind.ENDED, Outcome():
            error = f": {subject.error}" if subject.error else ""
            return (
                f"ended {subject.finish_reason} after {subject.attempts} attempt(s), "
                f"{len(subject.tokens)} tokens{error}"
            )
        case _, Record(data=data):
            reason = data.get("reason")
            return f"{mark.kind.replace('_', ' ')} by {mark.worker_id}" + (f" ({reason})" if reason else "")
    return str(mark.kind)


def _timeline(trail: Trail) -> list[Mark]:
    marks = list(trail.marks)
    for attempt, run in sorted(trail.deltas.items()):
        marks.append(Mark(run.first_t, attempt, MarkKind.FIRST_TOKEN, run.worker_id, run))
        marks.append(Mark(run.last_t, attempt, MarkKind.DELTAS, run.worker_id, run))
    late = {MarkKind.FIRST_TOKEN: 1, MarkKind.DELTAS: 2, MarkKind.ENDED: 3}
    return sorted(marks, key=lambda m: (m.t, late.get(m.kind, 0)))


def request_detail(tap: ClusterTap, request_id: str) -> dict[str, Any] | None:
    """One request in full (see the module contract); None when the tap no longer holds it."""
    trail = tap.trails.get(request_id)
    if trail is None:
        return None
    history = trail.history()
    return {
        **_request_summary(tap, trail),
        "timeline": [
            {
                "offset_ms": (m.t - trail.arrived) * 1000,
                "time": tap.wall_time(m.t),
                "attempt": m.attempt,
                "kind": str(m.kind),
                "worker_id": m.worker_id,
                "text": describe(m, trail),
            }
            for m in _timeline(trail)
        ],
        "explain": [] if history is None else explain_lines(history),
        "from_store": False,
    }


def stored_detail(history: RequestHistory) -> dict[str, Any]:
    """A request the tap no longer holds, from the fact store: its decisions, its outcome and what
    ``kvrelay explain`` prints; no timeline (the store keeps decisions, not marks) and ``from_store`` set."""
    outcome = history.outcome
    first = history.decisions[0] if history.decisions else None
    return {
        "request_id": history.request_id,
        "model": None if first is None else first.model,
        "arrived": None,
        "prompt_tokens": None,
        "bound_tokens": None,
        "decisions": [decision_view(d) for d in history.decisions],
        "finish_reason": None if outcome is None else outcome.finish_reason,
        "attempts": None if outcome is None else outcome.attempts,
        "ttft_ms": None if outcome is None or outcome.ttft_s is None else outcome.ttft_s * 1000,
        "cached_tokens": None
        if outcome is None
        else sum(n for tier, n in outcome.cached_tokens.items() if tier in CACHE_TIERS),
        "generated_tokens": None if outcome is None else outcome.generated_tokens,
        "error": None if outcome is None else outcome.error,
        "timeline": [],
        "explain": explain_lines(history),
        "from_store": True,
    }
