"""The router's and the worker's spans, made from the pure machines' events and effects and from a run's times,
exported to an in-memory exporter."""

from __future__ import annotations

import subprocess
import sys

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from kvrelay.core.router.events import Effect, MessageReceived, Request, RequestArrived, RouterEvent, SendOffer
from kvrelay.core.router.machine import new_router, step
from kvrelay.protocol.messages import Assignment, Offer, OfferResult, Result, Usage
from kvrelay.telemetry.router_spans import RouterSpans
from kvrelay.telemetry.tracing import Tracing
from kvrelay.telemetry.worker_spans import WorkerSpans
from kvrelay.worker.admission import Admission
from kvrelay.worker.handlers import Run
from tests.support.router_driver import heartbeat

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE}-{CLIENT_SPAN}-01"


def tracing() -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider, "test"), exporter


def ids(span: ReadableSpan) -> tuple[str, str, str]:
    """(trace id, span id, parent span id) in hex."""
    ctx, parent = span.get_span_context(), span.parent
    assert ctx is not None
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}", "" if parent is None else f"{parent.span_id:016x}"


def test_a_declined_then_accepted_request_has_two_routes_two_offers_and_one_result_in_the_clients_trace() -> None:
    t, exporter = tracing()
    spans = RouterSpans(t)
    state = new_router()
    clock = iter(range(1, 100))

    def feed(event: RouterEvent) -> list[Effect]:
        nonlocal state
        start = next(clock) * 1_000_000
        state, effects = step(state, event)
        return spans.observe(event, effects, start, start + 500_000)

    feed(MessageReceived(0.0, heartbeat("w0")))
    feed(MessageReceived(0.0, heartbeat("w1")))
    (first,) = [
        e
        for e in feed(RequestArrived(0.1, Request("r", "m", tuple(range(200)), 4, traceparent=TRACEPARENT)))
        if isinstance(e, SendOffer)
    ]
    declined = OfferResult(
        assignment=first.offer.assignment, worker_id=first.worker_id, epoch=1, accepted=False, reason="no_capacity"
    )
    (second,) = [e for e in feed(MessageReceived(0.2, declined)) if isinstance(e, SendOffer)]
    a = second.offer.assignment
    feed(MessageReceived(0.3, OfferResult(assignment=a, worker_id=second.worker_id, epoch=1, accepted=True)))
    feed(
        MessageReceived(
            0.4,
            Result(
                assignment=a,
                worker_id=second.worker_id,
                tokens=(1, 2, 3, 4),
                finish_reason="length",
                usage=Usage(cached_tokens={"gpu": 64}),
            ),
        )
    )

    finished = exporter.get_finished_spans()
    assert sorted(s.name for s in finished) == ["offer", "offer", "result", "route", "route"]
    assert {ids(s)[0] for s in finished} == {TRACE}
    assert {ids(s)[2] for s in finished} == {CLIENT_SPAN}
    offers = [s for s in finished if s.name == "offer"]
    assert [s.attributes["kvrelay.attempt"] for s in offers] == [1, 2]
    assert offers[0].status.status_code is StatusCode.ERROR and offers[0].attributes["kvrelay.outcome"] == "declined"
    assert [e.name for e in offers[1].events] == ["accepted"]
    # Each offer carries its own attempt's span, so the worker's spans hang under it.
    for offer, sent in zip(offers, (first, second)):
        assert sent.offer.traceparent == f"00-{TRACE}-{ids(offer)[1]}-01"
    (result,) = [s for s in finished if s.name == "result"]
    assert result.attributes["kvrelay.finish_reason"] == "length" and result.attributes["kvrelay.cached_tokens"] == 64


def test_a_runs_spans_follow_its_recorded_times_under_the_offers_span() -> None:
    t, exporter = tracing()
    offer = Offer(
        assignment=Assignment("r", 1),
        worker_id="w0",
        epoch=1,
        model="m",
        prompt=tuple(range(100)),
        max_new_tokens=2,
        traceparent=TRACEPARENT,
    )
    run = Run(
        offer,
        lambda m: None,
        Admission(True),
        [],
        0,
        0,
        b"",
        offered_at=10.0,
        accepted_at=10.001,
        restore_started_at=10.002,
        restore_s=0.5,
        submitted_at=10.6,
        token_times=[11.0, 11.1],
        generated=[7, 8],
        cached_tokens={"ram": 64},
        bytes_by_tier={"ram": 4096},
    )
    WorkerSpans(t, "w0").ended(run, now=11.2)
    by_name = {s.name: s for s in exporter.get_finished_spans()}
    assert set(by_name) == {"admission", "restore", "prefill", "decode"}
    assert {ids(s)[2] for s in by_name.values()} == {CLIENT_SPAN}
    restore = by_name["restore"]
    assert restore.end_time - restore.start_time == 500_000_000
    assert restore.attributes["kvrelay.bytes.ram"] == 4096
    assert by_name["prefill"].end_time == by_name["decode"].start_time
    assert by_name["decode"].attributes["kvrelay.cached_tokens"] == 64
    assert by_name["decode"].attributes["kvrelay.finish_reason"] == "fenced"


def test_with_tracing_off_the_faces_never_import_the_sdk() -> None:
    """No ``--otlp-endpoint``: ``start_tracing`` gives None and no face module has imported OpenTelemetry's SDK."""
    code = (
        "import sys\n"
        "import kvrelay.launch.router, kvrelay.launch.worker, kvrelay.launch.serve, kvrelay.launch.cluster\n"
        "from kvrelay.launch.tracing import start_tracing\n"
        "assert start_tracing(None, 'kvrelay-router') is None\n"
        "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'kvrelay.telemetry'))))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]"
