"""``kvrelay serve``: the embedded default, everything in one process.

One asyncio loop holds the HTTP ingress, the router stack (``launch.router_stack``:
router, fact store, metrics, ingress, app) and one worker controller; a device
thread runs the model. The router and the worker talk through the same
protocol messages as over WebSockets, handed over with ``loop.call_soon`` so
neither re-enters the other. Facts go to SQLite under the data directory unless
``--db`` names another URL.

A fence notice from the router reaches the worker the same way: when the loop
stalled past the worker expiry (a long request on the loop, a paused process),
the router fences the worker's epoch and answers its next heartbeat with
``Fenced``; the worker moves to a new epoch and is routed again at once.

On SIGINT/SIGTERM the server drains within ``drain_s`` (``launch.drain``), then
stops the router, the worker and the fact store (every recorded outcome
written), and ``serve`` returns normally, so the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

from fastapi import FastAPI

from kvrelay.api.ingress import Ingress
from kvrelay.api.metrics import Read
from kvrelay.api.served_model import ServedModel
from kvrelay.core.router.machine import RouterConfig
from kvrelay.facts.store import FactStore
from kvrelay.launch import defaults
from kvrelay.launch.drain import serve_until_stopped
from kvrelay.launch.heap import freeze_startup_objects
from kvrelay.launch.router_stack import RouterStack, build_router_stack
from kvrelay.launch.sockets import listen
from kvrelay.launch.tracing import start_tracing
from kvrelay.launch.worker_assembly import StoreSpec, WorkerParts, WorkerSettings, build_worker
from kvrelay.protocol.messages import Cancel, Fenced, Offer, WireMessage
from kvrelay.router.cluster_router import ClusterRouter
from kvrelay.worker.host import WorkerController
from kvrelay.worker.runtime.loop import PagedRuntime

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """One embedded server: where it listens, its fact store, its one worker (``worker.store``
    None: chunk files under the data directory, ``chunks/<worker_id>``), the bound on request
    bodies (None: from the model's context), and how long it drains on SIGINT/SIGTERM."""

    host: str = defaults.HOST
    port: int = defaults.HTTP_PORT
    db_url: str | None = None
    heartbeat_s: float = defaults.HEARTBEAT_S
    max_body_bytes: int | None = None
    drain_s: float = defaults.DRAIN_S
    otlp_endpoint: str | None = None
    """Export request traces (router and worker spans) over OTLP/HTTP to this collector; None: no tracing."""
    worker: WorkerSettings = field(default_factory=lambda: WorkerSettings(defaults.SERVE_WORKER_ID))


@dataclass
class Embedded:
    """The parts of one embedded server, wired; ``close`` stops them in order."""

    stack: RouterStack
    worker: WorkerParts
    served: ServedModel

    @property
    def router(self) -> ClusterRouter:
        return self.stack.router

    @property
    def ingress(self) -> Ingress:
        return self.stack.ingress

    @property
    def facts(self) -> FactStore:
        return self.stack.facts

    @property
    def app(self) -> FastAPI:
        return self.stack.app

    @property
    def controller(self) -> WorkerController:
        return self.worker.controller

    @property
    def runtime(self) -> PagedRuntime:
        return self.worker.runtime

    async def close(self) -> None:
        await self.stack.router.close()
        self.stack.ingress.close()
        self.worker.close()
        self.stack.facts.close()


@contextlib.asynccontextmanager
async def embedded(options: ServeOptions) -> AsyncIterator[Embedded]:
    """Load the model and wire the router stack, worker and ingress on the running loop."""
    settings = options.worker
    if settings.store is None:
        settings = replace(settings, store=StoreSpec(defaults.chunk_dir(settings.worker_id)))
    worker = await build_worker(settings)
    artifacts, config, pool, controller = worker.artifacts, worker.config, worker.pool, worker.controller
    identity = controller.me
    loop = asyncio.get_running_loop()

    def to_worker(worker_id: str, message: WireMessage) -> None:
        if isinstance(message, Offer):
            loop.call_soon(controller.on_offer, message, to_router)
        elif isinstance(message, Cancel):
            loop.call_soon(controller.on_cancel, message)
        elif isinstance(message, Fenced):
            loop.call_soon(rejoin, message)

    def rejoin(fenced: Fenced) -> None:
        controller.on_fenced(fenced)
        to_router(controller.heartbeat())  # the new epoch, announced at once

    def to_router(message: WireMessage) -> None:
        loop.call_soon(router.receive, message)

    served = ServedModel(
        artifacts.name, artifacts.tokenizer, config.architecture, worker.context_limit, tuple(config.eos_token_ids)
    )
    tracing = start_tracing(options.otlp_endpoint, "kvrelay-serve")
    if tracing is not None:
        from kvrelay.telemetry.worker_spans import WorkerSpans

        controller.spans = WorkerSpans(tracing, identity.worker_id)
    stack = build_router_stack(
        config=RouterConfig(chunk_tokens=settings.chunk_tokens),
        policy=defaults.POLICY,
        db_url=options.db_url,
        send=to_worker,
        models={served.name: served},
        worker_pages=False,
        max_body_bytes=options.max_body_bytes,
        tracing=tracing,
    )
    router = stack.router
    controller.publish = to_router
    metrics = stack.metrics
    page_gauges: tuple[tuple[str, Callable[[], int], str], ...] = (
        ("kvrelay_pages_reserved", lambda: pool.num_reserved, "pages held by reservations"),
        ("kvrelay_pages_free", lambda: pool.num_free, "free pages"),
        ("kvrelay_pages_cached", lambda: pool.num_cached, "unreferenced pages holding cached chunks"),
        ("kvrelay_pages_in_use", lambda: pool.num_referenced, "pages referenced by running sequences"),
    )
    for name, read, help_ in page_gauges:
        metrics.gauge(name, _for_worker(identity.worker_id, read), help_)
    router.start()
    router.receive(controller.heartbeat())
    beat = loop.create_task(_heartbeats(router, controller, options.heartbeat_s))
    parts = Embedded(stack, worker, served)
    try:
        yield parts
    finally:
        beat.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beat
        await parts.close()
        if tracing is not None:
            await asyncio.to_thread(tracing.shutdown)


def _for_worker(worker_id: str, read: Callable[[], int]) -> Read:
    """``read()``'s value as the one series of ``worker_id``."""
    return lambda: {(("worker", worker_id),): float(read())}


async def _heartbeats(router: ClusterRouter, controller: WorkerController, every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        router.receive(controller.heartbeat())


async def serve(options: ServeOptions, on_ready: Callable[[str], None] = lambda url: None) -> None:
    """Serve until SIGINT/SIGTERM, drain within ``options.drain_s``, then close everything in order.

    ``on_ready(http_url)`` is called once the API listens (port 0 picks a free port).
    """
    async with embedded(options) as parts:
        sock = listen(options.host, options.port)

        def ready(port: int) -> None:
            freeze_startup_objects()
            url = f"http://{options.host}:{port}"
            log.info("serving %s on %s", parts.served.name, url)
            on_ready(url)

        try:
            await serve_until_stopped(parts.app, sock, parts.router, options.drain_s, ready, log_level="info")
        finally:
            sock.close()
    log.info("kvrelay serve stopped")
