"""``kvrelay serve``: the embedded default, everything in one process.

One asyncio loop holds the HTTP ingress, the router (``ClusterRouter``) and
one worker controller; a device thread runs the model. The router and the
worker talk through the same protocol messages as over WebSockets, handed
over with ``loop.call_soon`` so neither re-enters the other. Facts go to
SQLite under the data directory unless ``--db`` names another URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import uvicorn

from kvrelay.api.app import create_app
from kvrelay.api.ingress import Ingress, ServedModel
from kvrelay.api.metrics import Metrics
from kvrelay.api.router_metrics import add_router_metrics
from kvrelay.router.cluster_router import ClusterRouter
from kvrelay.core.router.machine import RouterConfig, new_router
from kvrelay.facts.replica_map import ReplicaMap
from kvrelay.facts.sink import record_sink
from kvrelay.facts.store import FactStore
from kvrelay.paths import data_dir
from kvrelay.launch.worker_assembly import StoreSpec, WorkerParts, WorkerSpec, build_worker
from kvrelay.protocol.messages import Cancel, Offer, WireMessage
from kvrelay.worker.host import WorkerController
from kvrelay.worker.runtime.loop import PagedRuntime

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """One embedded server: where it listens, its fact store, and its one worker (``worker.store``
    None: chunk files under the data directory, ``chunks/<worker_id>``)."""

    host: str = "127.0.0.1"
    port: int = 8000
    db_url: str | None = None
    heartbeat_s: float = 0.5
    worker: WorkerSpec = field(default_factory=lambda: WorkerSpec("local-0"))


@dataclass
class Embedded:
    """The parts of one embedded server, wired; ``close`` stops them in order."""

    router: ClusterRouter
    controller: WorkerController
    runtime: PagedRuntime
    ingress: Ingress
    facts: FactStore
    served: ServedModel
    worker: WorkerParts

    async def close(self) -> None:
        await self.router.close()
        self.worker.close()
        self.facts.close()


@contextlib.asynccontextmanager
async def embedded(options: ServeOptions) -> AsyncIterator[Embedded]:
    """Load the model and wire router, worker and ingress on the running loop."""
    spec = options.worker
    if spec.store is None:
        spec = replace(spec, store=StoreSpec(str(data_dir() / "chunks" / spec.worker_id)))
    worker = await build_worker(spec)
    artifacts, config, runtime, pool, controller = (worker.artifacts, worker.config, worker.runtime, worker.pool,
                                                    worker.controller)
    context_limit = worker.context_limit
    identity = controller.me
    facts = FactStore(options.db_url)
    replica_map = ReplicaMap.load(facts.engine)
    loop = asyncio.get_running_loop()

    def to_worker(worker_id: str, message: WireMessage) -> None:
        if isinstance(message, Offer):
            loop.call_soon(controller.on_offer, message, to_router)
        elif isinstance(message, Cancel):
            loop.call_soon(controller.on_cancel, message)

    def to_router(message: WireMessage) -> None:
        loop.call_soon(router.receive, message)

    router = ClusterRouter(new_router(RouterConfig(chunk_tokens=spec.chunk_tokens)), to_worker,
                           record_sink(facts, replica_map), replicas=replica_map)
    controller.publish = to_router
    served = ServedModel(artifacts.name, artifacts.tokenizer, config.architecture, context_limit,
                         tuple(config.eos_token_ids))

    def serving(name: str) -> bool:
        return any(name in v.heartbeat.models for v in router.state.views.values())

    metrics = Metrics()
    metrics.gauge("kvrelay_pages_reserved", lambda: {(("worker", identity.worker_id),): pool.num_reserved},
                  "pages held by reservations")
    metrics.gauge("kvrelay_pages_free", lambda: {(("worker", identity.worker_id),): pool.num_free}, "free pages")
    metrics.gauge("kvrelay_pages_cached", lambda: {(("worker", identity.worker_id),): pool.num_cached},
                  "unreferenced pages holding cached chunks")
    metrics.gauge("kvrelay_pages_in_use", lambda: {(("worker", identity.worker_id),): pool.num_referenced},
                  "pages referenced by running sequences")
    add_router_metrics(metrics, router, worker_pages=False)
    metrics.gauge("kvrelay_router_events", lambda: {(("counter", k),): v for k, v in router.state.counters.items()},
                  "every router counter")
    ingress = Ingress(router, {served.name: served}, metrics, serving)
    router.start()
    router.receive(controller.heartbeat())
    beat = loop.create_task(_heartbeats(router, controller, options.heartbeat_s))
    parts = Embedded(router, controller, runtime, ingress, facts, served, worker)
    try:
        yield parts
    finally:
        beat.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beat
        await parts.close()


async def _heartbeats(router: ClusterRouter, controller: WorkerController, every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        router.receive(controller.heartbeat())


async def serve(options: ServeOptions) -> None:
    async with embedded(options) as parts:
        app = create_app(parts.ingress)
        server = uvicorn.Server(uvicorn.Config(app, host=options.host, port=options.port, log_level="info"))
        log.info("serving %s on http://%s:%d", parts.served.name, options.host, options.port)
        await server.serve()
