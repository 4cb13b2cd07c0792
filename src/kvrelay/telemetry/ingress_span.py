"""The ingress's span of one request: the root of the request's spans in the router process."""

from __future__ import annotations

from opentelemetry.trace import Span, SpanKind

from kvrelay.telemetry.tracing import Tracing, parent, traceparent_of


def start_ingress_span(
    tracing: Tracing, client_traceparent: str, request_id: str, model: str, prompt_tokens: int
) -> tuple[Span, str]:
    """Start the ``ingress`` span (a child of the client's context, or a new trace for ``""``); return it and
    the ``traceparent`` the router's spans continue from. The caller ends it when the request ends."""
    span = tracing.tracer("kvrelay.ingress").start_span(
        "ingress",
        parent(client_traceparent),
        SpanKind.SERVER,
        {"kvrelay.request_id": request_id, "kvrelay.model": model, "kvrelay.prompt_tokens": prompt_tokens},
    )
    return span, traceparent_of(span)
