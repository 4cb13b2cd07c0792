"""``kvrelay worker``: one worker (model, runtime, page pool, controller) linked to one or several routers.

Contract:
- The worker loads its model, then keeps a WebSocket link to every router URL
  (``transport.worker_endpoint``), authenticated with the shared secret. When
  a link drops, the controller moves to a new epoch (``on_disconnect``), so
  every assignment of the old epoch is fenced and its pages come back once the
  step in flight has finished. ``on_ready(worker_id, epoch, model, status_url)``
  is called once the model is loaded and the links are starting.
- Graceful shutdown on SIGINT/SIGTERM: the controller declines every new offer
  (``shutting_down``); running work gets ``grace_s`` to finish; what is still
  running then is handed over (a ``cancelled`` Result with the tokens so far,
  which the router continues elsewhere as a continuation). Then the endpoint
  closes, the controller's remaining work quiesces, and only then the runtime
  (the device thread) stops.
- Every time the controller's reservations drop to none, the controller logs
  "holds no reservations", so an operator (or a test) can see a fenced
  assignment's pages come back.
- A read-only status listener (``launch/status.py``, on ``status_host``,
  127.0.0.1 by default) shows the worker's epoch, its reservations and runs,
  and for a native worker its pages and the chunk keys each local tier holds
  (``worker_status``).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Sized
from dataclasses import dataclass
from typing import Any, Protocol

from kvrelay.core.worker.machine import WorkerState
from kvrelay.engines.vllm.host import VllmWorker
from kvrelay.launch import defaults
from kvrelay.launch.heap import freeze_startup_objects
from kvrelay.launch.status import StatusServer
from kvrelay.launch.tracing import start_tracing
from kvrelay.launch.vllm_worker import VllmSettings, build_vllm_worker
from kvrelay.launch.worker_assembly import WorkerSettings, build_worker
from kvrelay.transport.worker_endpoint import WorkerEndpoint
from kvrelay.worker.host import WorkerController

log = logging.getLogger(__name__)

QUIESCE_S = 10.0
"""How long a handed-over or fenced step may take to finish before the runtime stops anyway."""


class DrainableHost(Protocol):
    """What ``drain`` needs of a worker host (``WorkerController``, or the vLLM worker)."""

    @property
    def worker_id(self) -> str: ...

    @property
    def state(self) -> WorkerState: ...

    @property
    def runs(self) -> Sized: ...

    @property
    def quiesced(self) -> asyncio.Event: ...

    def shut_down(self) -> None: ...

    def hand_over(self) -> int: ...


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    """One worker process: what it builds, the routers it links to, their secret, heartbeat and drain periods."""

    settings: WorkerSettings | VllmSettings
    """A native worker's, or a vLLM worker's (``kvrelay worker --engine vllm``)."""
    router_urls: tuple[str, ...]
    secret: bytes
    heartbeat_s: float = defaults.HEARTBEAT_S
    grace_s: float = defaults.GRACE_S
    otlp_endpoint: str | None = None
    """Export each attempt's spans over OTLP/HTTP to this collector (a native worker; None: no tracing)."""
    status_host: str = defaults.STATUS_HOST
    status_port: int = 0


def worker_status(host: WorkerController | VllmWorker, endpoint: WorkerEndpoint) -> dict[str, Any]:
    """What the status listener answers: epoch, reservations, runs and the routers linked; for a native worker also
    its pages and the hex chunk keys of each local tier (gpu: the page pool's prefix index; ram and ssd: the chunk
    store's)."""
    status: dict[str, Any] = {
        "worker_id": host.worker_id,
        "epoch": host.epoch,
        "reservations": len(host.state.slots),
        "runs": len(host.runs),
        "routers": endpoint.connected(),
        "endpoint_counters": dict(endpoint.counters),
    }
    if isinstance(host, WorkerController):
        pool = host.pool
        status["pages"] = {
            "total": pool.num_pages,
            "free": pool.num_free,
            "cached": pool.num_cached,
            "referenced": pool.num_referenced,
            "reserved": pool.num_reserved,
        }
        keys = {"gpu": sorted(k.hex() for k in pool.resident_keys())}
        stack = getattr(host.restorer, "stack", None)
        if stack is not None:
            keys.update({tier.name: sorted(k.hex() for k in tier.keys()) for tier in stack.local_tiers})
        status["keys"] = keys
    return status


async def run_worker(
    options: WorkerOptions, on_ready: Callable[[str, int, str, str], None] = lambda w, e, m, s: None
) -> None:
    """Serve until SIGINT/SIGTERM, then drain (see the module contract)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    host: WorkerController | VllmWorker
    if isinstance(options.settings, VllmSettings):
        vllm = await build_vllm_worker(options.settings)
        host, name = vllm.controller, vllm.name
    else:
        native = await build_worker(options.settings)
        host, name = native.controller, native.artifacts.name
    tracing = start_tracing(options.otlp_endpoint, "kvrelay-worker", host.worker_id)
    if tracing is not None and isinstance(host, WorkerController):
        from kvrelay.telemetry.worker_spans import WorkerSpans

        host.spans = WorkerSpans(tracing, host.worker_id)
    elif tracing is not None:
        log.warning("worker %s: a vLLM worker exports no spans of its own; the router's still trace it", host.worker_id)
    endpoint = WorkerEndpoint(host, options.router_urls, options.secret, heartbeat_interval_s=options.heartbeat_s)
    host.publish = endpoint.publish
    if isinstance(options.settings, VllmSettings):
        vllm.start()
    status = StatusServer(lambda: worker_status(host, endpoint), options.status_host, options.status_port)
    await status.start()
    await endpoint.start()
    freeze_startup_objects()
    on_ready(host.worker_id, host.epoch, name, status.url)
    log.info(
        "worker %s (epoch %d) serves %s; routers: %s", host.worker_id, host.epoch, name, ", ".join(options.router_urls)
    )
    try:
        await stop.wait()
        await drain(host, endpoint, options.grace_s)
    finally:
        await endpoint.close()
        await status.close()
        if isinstance(options.settings, VllmSettings):
            await vllm.aclose()
        else:
            native.close()
        if tracing is not None:
            await asyncio.to_thread(tracing.shutdown)
        log.info("worker %s stopped", host.worker_id)


async def drain(controller: DrainableHost, endpoint: WorkerEndpoint, grace_s: float) -> None:
    """Decline new offers, let running work finish within ``grace_s``, hand the rest over, close the link."""
    controller.shut_down()
    log.info(
        "worker %s shutting down: %d assignments running, grace %.1f s",
        controller.worker_id,
        len(controller.runs),
        grace_s,
    )
    if not await _quiesce(controller, grace_s):
        handed = controller.hand_over()
        log.info("worker %s handed over %d assignments as continuations", controller.worker_id, handed)
        await _quiesce(controller, QUIESCE_S)
    await endpoint.close()
    if not await _quiesce(controller, QUIESCE_S):
        log.warning(
            "worker %s: work still in flight after %.0f s; stopping the runtime anyway", controller.worker_id, QUIESCE_S
        )


async def _quiesce(controller: DrainableHost, timeout_s: float) -> bool:
    """Wait until the controller holds no reservation; False after ``timeout_s``."""
    if not controller.state.slots:
        return True
    try:
        await asyncio.wait_for(controller.quiesced.wait(), timeout_s)
    except TimeoutError:
        return False
    return True
