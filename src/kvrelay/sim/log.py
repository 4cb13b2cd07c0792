"""One-line, byte-stable descriptions of router events, effects and wire messages for the sim log.

Only identifiers, counts and times appear (never a whole prompt), formatted with
fixed precision, so the same run always writes the same bytes.
"""

from __future__ import annotations

from typing import assert_never

from kvrelay.core.router.events import (
    CancelTimer,
    ConsumerCancelled,
    DeliverDelta,
    DeliverResult,
    DrainDeadline,
    DrainStarted,
    Effect,
    LoadReplicas,
    MessageReceived,
    Record,
    ReplicasKnown,
    RequestArrived,
    RouterEvent,
    SendCancel,
    SendFenced,
    SendOffer,
    StartTimer,
    Tick,
    TimerFired,
    WorkerUnavailable,
)
from kvrelay.protocol.messages import (
    Assignment,
    Cancel,
    Delta,
    Fenced,
    Heartbeat,
    Offer,
    OfferResult,
    Residency,
    Result,
    WireMessage,
)


def _a(a: Assignment) -> str:
    return f"{a.request_id}#{a.attempt}"


def describe(obj: RouterEvent | Effect | WireMessage) -> str:
    """A stable one-line description of ``obj``."""
    match obj:
        case Offer():
            route = ",".join(f"{s.tier}:{s.chunks}" for s in obj.route) or "-"
            return (
                f"offer {_a(obj.assignment)} {obj.worker_id} e{obj.epoch} prompt={len(obj.prompt)} "
                f"max_new={obj.max_new_tokens} before={obj.generated_before} route={route}"
            )
        case Cancel():
            return f"cancel {_a(obj.assignment)} {obj.worker_id} ({obj.reason})"
        case Fenced():
            return f"fenced {obj.worker_id} e{obj.epoch}"
        case OfferResult():
            verdict = "accepted" if obj.accepted else f"declined:{obj.reason}"
            return f"offer_result {_a(obj.assignment)} {obj.worker_id} {verdict}"
        case Delta():
            return f"delta {_a(obj.assignment)} {obj.worker_id} seq={obj.seq} {list(obj.tokens)}"
        case Result():
            return f"result {_a(obj.assignment)} {obj.worker_id} {obj.finish_reason} n={len(obj.tokens)}"
        case Heartbeat():
            return (
                f"heartbeat {obj.worker_id} e{obj.epoch} s{obj.seq} free={obj.pages_free} "
                f"queue={obj.queue_delay_s:.6f} lanes={obj.active_lanes}"
            )
        case Residency():
            return (
                f"residency {obj.worker_id} e{obj.epoch} s{obj.seq} {obj.tier} +{len(obj.stored)} -{len(obj.removed)}"
            )
        case RequestArrived():
            r = obj.request
            return f"arrived {r.request_id} prompt={len(r.prompt)} max_new={r.max_new_tokens}"
        case MessageReceived():
            return describe(obj.message)
        case TimerFired():
            return f"timer {obj.timer[0]} {obj.timer[1]}#{obj.timer[2]}"
        case WorkerUnavailable():
            return f"unavailable {obj.worker_id} e{obj.epoch}"
        case ConsumerCancelled():
            return f"consumer_cancel {obj.request_id}"
        case Tick():
            return "tick"
        case DrainStarted():
            return "drain_started"
        case DrainDeadline():
            return "drain_deadline"
        case SendOffer():
            return describe(obj.offer)
        case SendCancel():
            return describe(obj.cancel)
        case SendFenced():
            return describe(obj.fenced)
        case StartTimer():
            return f"start_timer {obj.timer[0]} {obj.timer[1]}#{obj.timer[2]} at={obj.at:.6f}"
        case CancelTimer():
            return f"cancel_timer {obj.timer[0]} {obj.timer[1]}#{obj.timer[2]}"
        case DeliverDelta():
            return f"deliver {obj.request_id} @{obj.index} {list(obj.tokens)}"
        case DeliverResult():
            o = obj.outcome
            return f"outcome {o.request_id} {o.finish_reason} n={len(o.tokens)} attempts={o.attempts} error={o.error}"
        case ReplicasKnown() | Record() | LoadReplicas():
            return type(obj).__name__
        case _:
            assert_never(obj)
