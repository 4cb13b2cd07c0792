"""The worker's spans of one attempt, built when the attempt ends from the times its run recorded.

Children of the router's ``offer`` span (``Offer.traceparent``; a new trace for an offer without one):

- ``admission``: the offer's check against the real page pool and the atomic reservation; accepted or
  declined with its reason, and the device prefix it found;
- ``restore``: copying the route's lower-tier chunks into device pages (tiers and bytes), when there were any;
- ``prefill``: from entering the device queue to the first token (its wait behind other work included);
- ``decode``: from the first token to the end of the job (tokens, how it ended, the usage it reports).

Nothing is exported while the attempt runs: the worker's hot paths only note times they note anyway
(``worker.handlers.Run``), and the spans are made once, at release.
"""

from __future__ import annotations

import time

from opentelemetry.trace import Status, StatusCode
from opentelemetry.util.types import AttributeValue

from kvrelay.protocol.messages import DeclineReason, FinishReason, Offer
from kvrelay.telemetry.tracing import Tracing, at_ns, parent
from kvrelay.worker.accounting import usage_of
from kvrelay.worker.handlers import Run


class WorkerSpans:
    """Spans of the attempts of one worker (see the module docstring)."""

    def __init__(self, tracing: Tracing, worker_id: str) -> None:
        self.tracer = tracing.tracer("kvrelay.worker")
        self.worker_id = worker_id

    def declined(self, offer: Offer, offered_at: float, now: float, reason: DeclineReason | None, detail: str) -> None:
        """An ``admission`` span of an offer the worker declined."""
        wall = time.time_ns()
        span = self.tracer.start_span(
            "admission",
            parent(offer.traceparent),
            attributes={**self._ids(offer), "kvrelay.accepted": False, "kvrelay.reason": str(reason or "")},
            start_time=at_ns(offered_at, now, wall),
        )
        span.set_status(Status(StatusCode.ERROR, f"declined: {reason} {detail}".strip()))
        span.end(wall)

    def ended(self, run: Run, now: float) -> None:
        """The spans of an admitted attempt, at its release (``now`` on the worker's clock)."""
        wall = time.time_ns()
        ctx = parent(run.offer.traceparent)
        ids = self._ids(run.offer)

        def span(name: str, start: float, end: float, attributes: dict[str, AttributeValue]) -> None:
            s = self.tracer.start_span(name, ctx, attributes={**ids, **attributes}, start_time=at_ns(start, now, wall))
            s.end(at_ns(end, now, wall))

        span(
            "admission",
            run.offered_at,
            run.accepted_at,
            {"kvrelay.accepted": True, "kvrelay.gpu_tokens": run.cached_tokens.get("gpu", 0)},
        )
        if run.restore_started_at:
            restored: dict[str, AttributeValue] = {f"kvrelay.bytes.{t}": n for t, n in run.bytes_by_tier.items()}
            span("restore", run.restore_started_at, run.restore_started_at + run.restore_s, restored)
        times = run.token_times
        if run.submitted_at:
            span(
                "prefill",
                run.submitted_at,
                times[0] if times else now,
                {"kvrelay.prompt_tokens": len(run.offer.prompt)},
            )
        if times:
            usage = usage_of(run)
            decode = self.tracer.start_span(
                "decode",
                ctx,
                attributes={
                    **ids,
                    "kvrelay.generated_tokens": len(run.generated),
                    "kvrelay.finish_reason": str(run.finish_reason or "fenced"),
                    "kvrelay.cached_tokens": sum(usage.cached_tokens.values()),
                    "kvrelay.recomputed_tokens": usage.recomputed_tokens,
                },
                start_time=at_ns(times[0], now, wall),
            )
            if run.finish_reason is FinishReason.ERROR:
                decode.set_status(Status(StatusCode.ERROR, "the job failed"))
            decode.end(wall)

    def _ids(self, offer: Offer) -> dict[str, AttributeValue]:
        return {
            "kvrelay.request_id": offer.assignment.request_id,
            "kvrelay.attempt": offer.assignment.attempt,
            "kvrelay.worker_id": self.worker_id,
        }
