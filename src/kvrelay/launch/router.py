"""``kvrelay router``: the HTTP ingress, the router and the workers' WebSocket endpoint in one process.

Contract:
- HTTP (the OpenAI-compatible API, ``/health``, ``/metrics``, and ``/cluster``:
  live workers, requests in flight and counters as JSON) listens on
  ``host:port``; workers connect over WebSocket at
  ``ws://host:worker_port/workers`` (the transport's own server, on a port of
  its own). Port 0 picks a free port; ``on_ready(http_url, workers_url,
  status_url)`` is called once they listen, with the bound ports.
- A read-only status listener (``launch/status.py``, on ``status_host``,
  127.0.0.1 by default) shows the router's residency index by worker and tier,
  the requests in flight and queued, and the counters (``router_status``).
- The models the ingress offers are learned from heartbeats (``ModelCatalog``);
  the router loads only the tokenizers of ``model_sources``.
- ``engines``: vLLM servers the router drives from its own process (``launch.attached_engines``), each a
  worker of the cluster beside those that connect; with no ``model_sources`` given, the router loads the
  tokenizers of the directories they serve.
- On SIGINT/SIGTERM the HTTP face drains within ``drain_s`` (``launch.drain``:
  no new request; running ones go on while the workers stay linked; what is
  still running at the bound ends with an error event that says so), then the
  worker endpoint closes (workers see close code 1001 and reconnect to whatever
  listens next), then the router's timers and the fact store (flushed: every
  recorded outcome written); ``run_router`` returns normally.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvrelay.core.router.machine import RouterConfig
from kvrelay.core.router.reuse import reuse_figures
from kvrelay.launch import defaults
from kvrelay.launch.attached_engines import AttachedEngines, attach_engines
from kvrelay.launch.catalog import ModelCatalog, load_served_model
from kvrelay.launch.drain import serve_until_stopped
from kvrelay.launch.heap import freeze_startup_objects
from kvrelay.launch.router_stack import build_router_stack
from kvrelay.launch.sockets import listen
from kvrelay.launch.status import StatusServer
from kvrelay.launch.tracing import start_tracing
from kvrelay.launch.vllm_worker import VllmSettings
from kvrelay.protocol.messages import Heartbeat, WireMessage
from kvrelay.router.cluster_router import ClusterRouter
from kvrelay.transport.router_endpoint import RouterEndpoint, registry_liveness

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RouterOptions:
    """One router process: its secret, where it listens, the models whose tokenizers it loads, its fact store,
    policy, the pure router's configuration (chunk size and timeouts), and the bound on request bodies (None: from
    the served models' contexts)."""

    secret: bytes
    host: str = defaults.HOST
    port: int = defaults.HTTP_PORT
    worker_port: int = defaults.WORKER_PORT
    model_sources: tuple[str | None, ...] = (None,)
    db_url: str | None = None
    policy: str = defaults.POLICY
    config: RouterConfig = field(default_factory=RouterConfig)
    max_body_bytes: int | None = None
    drain_s: float = defaults.DRAIN_S
    otlp_endpoint: str | None = None
    """Export request traces over OTLP/HTTP to this collector (``telemetry.tracing``); None: no tracing."""
    status_host: str = defaults.STATUS_HOST
    status_port: int = 0
    engines: tuple[VllmSettings, ...] = ()
    """vLLM servers this process drives as workers (module contract)."""
    heartbeat_s: float = defaults.HEARTBEAT_S
    """Seconds between the heartbeats of the attached engines' workers."""


class _HeartbeatTap:
    """The endpoint's sink: the router, with every accepted heartbeat shown to the catalog first."""

    def __init__(self, router: ClusterRouter, catalog: ModelCatalog) -> None:
        self.router = router
        self.catalog = catalog

    def receive(self, message: WireMessage) -> None:
        if isinstance(message, Heartbeat):
            self.catalog.learn(message)
        self.router.receive(message)

    def worker_unavailable(self, worker_id: str, epoch: int) -> None:
        self.router.worker_unavailable(worker_id, epoch)


def cluster_snapshot(router: ClusterRouter, endpoint: RouterEndpoint) -> dict[str, Any]:
    """What ``/cluster`` answers: live workers (from their last heartbeat: pages, lanes, queue delay, speeds and the
    price of a request in flight, ``per_request_s``),
    requests in flight, counters, and the cumulative reuse figures (``reuse``: ``available_tokens``,
    ``captured_tokens``, ``delivered_tokens``, the values of ``kvrelay_reuse_*_tokens_total`` on ``/metrics``)."""
    workers = {
        wid: {
            "epoch": v.heartbeat.epoch,
            "seq": v.heartbeat.seq,
            "models": list(v.heartbeat.models),
            "pages_total": v.heartbeat.pages_total,
            "pages_free": v.heartbeat.pages_free,
            "pages_evictable": v.heartbeat.pages_evictable,
            "active_lanes": v.heartbeat.active_lanes,
            "queue_delay_s": v.heartbeat.queue_delay_s,
            "prefill_s_per_token": v.heartbeat.prefill_s_per_token,
            "decode_s_per_token": v.heartbeat.decode_s_per_token,
            "per_request_s": v.heartbeat.per_request_s,
        }
        for wid, v in sorted(router.state.views.items())
    }
    requests = {
        rid: {"worker_id": rs.worker_id, "attempt": rs.attempt, "phase": rs.phase, "delivered": len(rs.delivered)}
        for rid, rs in sorted(router.state.requests.items())
    }
    return {
        "workers": workers,
        "requests": requests,
        "router_counters": dict(router.state.counters),
        "reuse": reuse_figures(router.state.counters).as_dict(),
        "endpoint_counters": dict(endpoint.counters),
    }


def router_status(router: ClusterRouter) -> dict[str, Any]:
    """What the status listener answers: the residency index (hex keys by worker and tier, and the object tier's),
    the live workers' epochs, the requests in flight and those waiting in the router queues, and the counters."""
    local, shared = router.state.index.holdings()
    return {
        "index": {
            "workers": {
                wid: {tier: sorted(k.hex() for k in keys) for tier, keys in tiers.items()}
                for wid, tiers in sorted(local.items())
            },
            "object": sorted(k.hex() for k in shared),
            "forgotten": router.state.index.forgotten,
        },
        "live_workers": {wid: v.heartbeat.epoch for wid, v in sorted(router.state.views.items())},
        "requests": sorted(router.state.requests),
        "queued": sorted(rid for queue in router.state.queues.values() for rid in queue),
        "counters": dict(router.state.counters),
    }


async def run_router(options: RouterOptions, on_ready: Callable[[str, str, str], None] = lambda h, w, s: None) -> None:
    """Serve until SIGINT/SIGTERM, then drain and stop (see the module contract)."""
    attached = await attach_engines(options.engines, options.heartbeat_s)
    try:
        await _run_router(options, attached, on_ready)
    finally:
        await attached.close()


async def _run_router(
    options: RouterOptions, attached: AttachedEngines, on_ready: Callable[[str, str, str], None]
) -> None:
    sources = options.model_sources
    if attached.parts and sources == (None,):
        sources = tuple(str(d) for d in attached.model_dirs)
    loaded = {}
    for source in sources:
        served = await asyncio.to_thread(load_served_model, source)
        loaded[served.name] = served
    catalog = ModelCatalog(loaded)
    endpoint = RouterEndpoint(options.secret, host=options.host, port=options.worker_port)
    tracing = start_tracing(options.otlp_endpoint, "kvrelay-router")
    stack = build_router_stack(
        config=options.config,
        policy=options.policy,
        db_url=options.db_url,
        send=attached.send(endpoint.send),
        models=catalog.served,
        max_body_bytes=options.max_body_bytes,
        tracing=tracing,
        awaited=catalog.loaded.keys(),
    )
    router = stack.router
    stack.metrics.gauge(
        "kvrelay_endpoint_events",
        lambda: {(("counter", k),): v for k, v in endpoint.counters.items()},
        "worker endpoint counters (connections, refused handshakes, dropped frames by reason, ...)",
    )
    app = stack.app
    app.add_api_route("/cluster", lambda: cluster_snapshot(router, endpoint), methods=["GET"])
    router.start()
    sock: socket.socket | None = None
    status = StatusServer(lambda: router_status(router), options.status_host, options.status_port)

    def ready(port: int) -> None:
        freeze_startup_objects()
        on_ready(f"http://{options.host}:{port}", endpoint.url, status.url)
        log.info("router: HTTP on http://%s:%d, workers on %s", options.host, port, endpoint.url)

    try:
        await status.start()
        tap = _HeartbeatTap(router, catalog)
        await endpoint.start(tap, registry_liveness(router))
        attached.start(tap)
        sock = listen(options.host, options.port)
        await serve_until_stopped(app, sock, router, options.drain_s, ready)
    finally:
        await status.close()
        await endpoint.close()
        await attached.close()
        await stack.close()
        if sock is not None:
            sock.close()
        if tracing is not None:
            await asyncio.to_thread(tracing.shutdown)
        log.info("router stopped")
