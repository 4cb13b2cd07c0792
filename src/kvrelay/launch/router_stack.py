"""The live router stack, wired in one place for ``kvrelay serve`` and ``kvrelay router``.

Contract:
- ``build_router_stack`` opens the fact store (``db_url``; None: SQLite under
  the data directory), loads the durable replica map from it, and makes the
  ``ClusterRouter`` (the pure router of ``config`` and ``policy``; its records go
  to the store, its replicas start from the map; its messages to workers go to
  ``send``), the ``Metrics`` (the router's series, with the per-worker page
  gauges when ``worker_pages``, and ``kvrelay_router_events``: every router
  counter; and the fact store's written, lost and pending records,
  ``facts.metrics``), the ``Ingress`` over ``models`` (request bodies bounded by
  ``max_body_bytes``; None: the bound ``api.body`` derives from the models'
  contexts) and the FastAPI app, with the status page (``/dashboard``, read-only;
  ``dashboard.routes``) and its tap on the router. With ``tracing`` the router and the ingress export each
  request's spans (``telemetry``); without it they start none.
- ``models`` is the ingress's model table, read at each request, so a caller
  may keep adding to it (the router process learns models from heartbeats).
  A model is served while at least one live worker's last heartbeat names it.
- Nothing is started: the caller adds its own gauges and routes, wires its
  workers, then calls ``router.start()``. ``close`` stops the router's timers,
  then closes the fact store (flushing it) and logs what it wrote and lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import FastAPI

from kvrelay.api.app import create_app
from kvrelay.api.ingress import Ingress
from kvrelay.api.metrics import Metrics
from kvrelay.api.router_metrics import add_router_metrics
from kvrelay.api.served_model import ServedModel
from kvrelay.core.router.machine import RouterConfig, new_router
from kvrelay.dashboard.routes import add_dashboard
from kvrelay.dashboard.tap import ClusterTap
from kvrelay.facts.metrics import FactStoreCollector
from kvrelay.facts.replica_map import ReplicaMap
from kvrelay.facts.sink import record_sink
from kvrelay.facts.store import FactStore
from kvrelay.protocol.messages import WireMessage
from kvrelay.router.cluster_router import ClusterRouter

if TYPE_CHECKING:
    from kvrelay.telemetry.tracing import Tracing

log = logging.getLogger(__name__)

FACTS_CLOSE_S = 30.0
"""How long closing the stack waits for the fact writer to write what it holds (it gives up at the first
database failure, so a database that is down does not hold a shutdown this long)."""


@dataclass
class RouterStack:
    """One router with its fact store, replica map, metrics, ingress and HTTP app (see the module contract)."""

    router: ClusterRouter
    facts: FactStore
    replicas: ReplicaMap
    metrics: Metrics
    ingress: Ingress
    app: FastAPI
    dashboard: ClusterTap

    async def close(self) -> None:
        """Stop the router's timers, then close the fact store: every record it accepted is written (or
        counted as lost) before this returns, within ``FACTS_CLOSE_S``; the totals are logged."""
        await self.router.close()
        self.ingress.close()
        drained = await asyncio.to_thread(self.facts.close, FACTS_CLOSE_S)
        stats = self.facts.stats()
        lost = stats.dropped + stats.overflow + stats.rejected + stats.unknown_kinds + stats.closed_drops
        log.log(
            logging.INFO if drained and not lost else logging.WARNING,
            "fact store closed%s: %d records written, %d lost (dropped %d, overflow %d, rejected %d)",
            "" if drained else f" after {FACTS_CLOSE_S:.0f} s, its writer stopped",
            stats.written,
            lost,
            stats.dropped,
            stats.overflow,
            stats.rejected,
        )


def build_router_stack(
    *,
    config: RouterConfig,
    policy: str,
    db_url: str | None,
    send: Callable[[str, WireMessage], None],
    models: dict[str, ServedModel],
    worker_pages: bool = True,
    max_body_bytes: int | None = None,
    tracing: Tracing | None = None,
    awaited: Collection[str] = (),
) -> RouterStack:
    """Open the fact store and wire router, metrics, ingress and app (see the module contract)."""
    facts = FactStore(db_url)
    replicas = ReplicaMap.load(facts.engine)
    spans = None
    if tracing is not None:
        from kvrelay.telemetry.router_spans import RouterSpans

        spans = RouterSpans(tracing)
    router = ClusterRouter(
        new_router(config, policy), send, record_sink(facts, replicas), replicas=replicas, spans=spans
    )

    def serving(name: str) -> bool:
        return any(name in v.heartbeat.models for v in router.state.views.values())

    metrics = Metrics()
    add_router_metrics(metrics, router, worker_pages=worker_pages)
    metrics.gauge(
        "kvrelay_router_events",
        lambda: {(("counter", k),): v for k, v in router.state.counters.items()},
        "every router counter",
    )
    metrics.registry.register(FactStoreCollector(facts))
    ingress = Ingress(router, models, metrics, serving, max_body_bytes, tracing, awaited)
    app = create_app(ingress)
    return RouterStack(router, facts, replicas, metrics, ingress, app, add_dashboard(app, router, facts.reader))
