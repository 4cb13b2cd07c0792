"""The router's spans of a request, started and ended from the pure router's events and effects.

``RouterSpans.observe(event, effects, start_ns, end_ns)`` sees each step of the router machine (the wall-clock
time around it) and returns the effects to carry out, the same but for offers, which now carry the span of
their attempt as ``traceparent``. Per request, under the ingress's span (``Request.traceparent``):

- ``route``: the step that chose a worker (a ``decision`` record): policy, worker, cached tokens, candidates;
- ``offer``: one attempt, from its offer until the next attempt's offer, a decline, timeout, loss or cancel
  (``offer_outcome``), or the request's end; acceptance is an event on it. The worker's spans are its
  children (``Offer.traceparent``);
- ``result``: the request's one outcome (finish reason, attempts, tokens, usage, error).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from kvrelay.core.router.events import (
    DeliverResult,
    Effect,
    ErrorKind,
    OfferOutcome,
    Record,
    RecordKind,
    RequestArrived,
    RouterEvent,
    SendOffer,
)
from kvrelay.protocol.messages import FinishReason
from kvrelay.telemetry.tracing import Tracing, parent, traceparent_of


class RouterSpans:
    """Spans of the requests in flight at one router (see the module docstring)."""

    def __init__(self, tracing: Tracing) -> None:
        self.tracer = tracing.tracer("kvrelay.router")
        self._parents: dict[str, Context | None] = {}
        self._offers: dict[str, Span] = {}

    def observe(self, event: RouterEvent, effects: Sequence[Effect], start_ns: int, end_ns: int) -> list[Effect]:
        if isinstance(event, RequestArrived) and event.request.request_id not in self._parents:
            self._parents[event.request.request_id] = parent(event.request.traceparent)
        out: list[Effect] = []
        for effect in effects:
            match effect:
                case SendOffer(worker_id=wid, offer=offer):
                    rid = offer.assignment.request_id
                    self._end_offer(rid, end_ns)
                    span = self.tracer.start_span(
                        "offer",
                        self._parents.get(rid),
                        SpanKind.CLIENT,
                        {
                            "kvrelay.request_id": rid,
                            "kvrelay.attempt": offer.assignment.attempt,
                            "kvrelay.worker_id": wid,
                            "kvrelay.prompt_tokens": len(offer.prompt),
                            "kvrelay.generated_before": offer.generated_before,
                            "kvrelay.route": [f"{s.tier}:{s.chunks}" for s in offer.route],
                        },
                        start_time=end_ns,
                    )
                    self._offers[rid] = span
                    effect = SendOffer(wid, msgspec.structs.replace(offer, traceparent=traceparent_of(span)))
                case Record(kind=RecordKind.DECISION):
                    self._route(effect, start_ns, end_ns)
                case Record(kind=RecordKind.OFFER_OUTCOME, request_id=rid, data=data):
                    self._offer_outcome(rid, data, end_ns)
                case DeliverResult(request_id=rid, outcome=outcome):
                    duplicate = outcome.failure is not None and outcome.failure.kind is ErrorKind.DUPLICATE_REQUEST
                    if not duplicate:
                        self._end_offer(rid, end_ns)
                    ctx = self._parents.get(rid) if duplicate else self._parents.pop(rid, None)
                    span = self.tracer.start_span(
                        "result",
                        ctx,
                        attributes={
                            "kvrelay.request_id": rid,
                            "kvrelay.finish_reason": str(outcome.finish_reason),
                            "kvrelay.attempts": outcome.attempts,
                            "kvrelay.generated_tokens": len(outcome.tokens),
                            "kvrelay.cached_tokens": sum(outcome.usage.cached_tokens.values()),
                            "kvrelay.recomputed_tokens": outcome.usage.recomputed_tokens,
                        },
                        start_time=end_ns,
                    )
                    if outcome.finish_reason is FinishReason.ERROR:
                        span.set_status(Status(StatusCode.ERROR, outcome.error or ""))
                    span.end(end_ns)
            out.append(effect)
        return out

    def _route(self, record: Record, start_ns: int, end_ns: int) -> None:
        chosen = record.data["chosen"]
        span = self.tracer.start_span(
            "route",
            self._parents.get(record.request_id),
            attributes={
                "kvrelay.request_id": record.request_id,
                "kvrelay.attempt": record.attempt,
                "kvrelay.policy": str(record.data["policy"]),
                "kvrelay.worker_id": chosen.worker_id,
                "kvrelay.cached_tokens": chosen.cached_tokens,
                "kvrelay.predicted_ttft_s": chosen.predicted_ttft_s,
                "kvrelay.candidates": len(record.data["candidates"]),
            },
            start_time=start_ns,
        )
        span.end(end_ns)

    def _offer_outcome(self, rid: str, data: dict[str, Any], end_ns: int) -> None:
        """Acceptance is an event on the attempt's span; any other outcome ends it."""
        offer = self._offers.get(rid)
        if offer is None:
            return
        if data.get("outcome") == OfferOutcome.ACCEPTED:
            offer.add_event("accepted", timestamp=end_ns)
            return
        reason = str(data.get("reason") or "")
        offer.set_attribute("kvrelay.outcome", str(data.get("outcome")))
        offer.set_attribute("kvrelay.reason", reason)
        if data.get("outcome") != OfferOutcome.CANCELLED:
            offer.set_status(Status(StatusCode.ERROR, reason))
        self._end_offer(rid, end_ns)

    def _end_offer(self, rid: str, end_ns: int) -> None:
        span = self._offers.pop(rid, None)
        if span is not None:
            span.end(end_ns)
