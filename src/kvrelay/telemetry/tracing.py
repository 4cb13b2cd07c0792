"""One process's OpenTelemetry tracing: an OTLP/HTTP exporter, and W3C trace context in and out of spans.

Contract:
- ``Tracing.to(endpoint, service)`` exports this process's spans, batched, over OTLP/HTTP (protobuf) to
  ``endpoint``: a collector's base URL (``http://HOST:4318``), the spans going to ``/v1/traces`` under it; a
  URL that already ends in ``/v1/traces`` is used as it is. The provider is this object's own (nothing global
  is set); ``shutdown`` exports what is buffered and stops, and the SDK also does so when the process exits.
- Tracing is off unless a face is given ``--otlp-endpoint``: then no ``Tracing`` exists and the shells skip
  every span (one ``is None`` test per event).
- ``parent(traceparent)`` is the context a span continues (a new trace for ``""``);
  ``traceparent_of(span)`` is what a child in another process continues from.
- ``at_ns(t, now, wall_ns)`` turns a reading ``t`` of a monotonic clock into wall-clock nanoseconds, the
  time base spans are exported in.
"""

from __future__ import annotations

from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACES_PATH = "/v1/traces"
EXPORT_DELAY_MS = 1000
"""How long a finished span may wait in the batch before it is exported."""

_PROPAGATOR = TraceContextTextMapPropagator()


class Tracing:
    """The tracer provider of one process and the OTLP/HTTP exporter it feeds (see the module contract)."""

    def __init__(self, provider: TracerProvider, service: str) -> None:
        self.provider = provider
        self.service = service

    @classmethod
    def to(cls, endpoint: str, service: str, instance: str = "") -> Tracing:
        """Export the spans of ``service`` (``instance``: e.g. the worker id) to the collector at ``endpoint``."""
        url = endpoint.rstrip("/")
        if not url.endswith(TRACES_PATH):
            url += TRACES_PATH
        attributes = {"service.name": service}
        if instance:
            attributes["service.instance.id"] = instance
        provider = TracerProvider(resource=Resource.create(attributes))
        provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=url), schedule_delay_millis=EXPORT_DELAY_MS)
        )
        return cls(provider, service)

    def tracer(self, name: str) -> Tracer:
        return self.provider.get_tracer(name)

    def shutdown(self) -> None:
        """Export what is buffered and stop exporting."""
        self.provider.shutdown()


def parent(traceparent: str) -> Context | None:
    """The context a span with this W3C ``traceparent`` as its parent starts in (None: a new trace)."""
    if not traceparent:
        return None
    return _PROPAGATOR.extract({"traceparent": traceparent})


def traceparent_of(span: Span) -> str:
    """The W3C ``traceparent`` naming ``span`` as the parent of spans elsewhere."""
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def at_ns(t: float, now: float, wall_ns: int) -> int:
    """Wall-clock nanoseconds of ``t``, a reading of a monotonic clock that read ``now`` at ``wall_ns``."""
    return wall_ns - int((now - t) * 1e9)
