"""Serve an HTTP app until SIGINT or SIGTERM, then drain within a bound (``kvrelay serve`` and ``kvrelay router``).

Contract of ``serve_until_stopped(app, sock, router, drain_s, on_ready)``:
- uvicorn serves ``app`` on the listening socket ``sock`` (``launch.sockets.listen``). uvicorn's own
  signal handling is off: it re-raises the signal once it has stopped, which ends the process with 143
  before the caller can close its fact store. The first SIGINT or SIGTERM starts the drain instead.
  ``on_ready(port)`` is called once uvicorn serves.
- The drain: the router takes no new request (``ClusterRouter.start_drain``: each ends at once with a 503,
  code ``shutting_down``); uvicorn stops listening and closes idle connections; running requests go on for
  up to ``drain_s`` seconds. Then, or at a second signal, every request still in flight ends with a
  ``shutting_down`` error naming how many of its tokens were delivered (``end_drain``): a stream gets an SSE
  error event in OpenAI's format, a whole response a 503. uvicorn cancels whatever still runs
  ``DRAIN_GRACE_S`` seconds later.
- It returns once uvicorn has stopped and removes its signal handlers; the caller then closes the router,
  its workers and the fact store (flushed), and the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import socket
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, Literal

import uvicorn
from fastapi import FastAPI

from kvrelay.router.cluster_router import ClusterRouter

log = logging.getLogger(__name__)

DRAIN_GRACE_S = 5.0
"""After the drain's bound, how long responses may take to send their error before uvicorn cancels them."""
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Uvicorn(uvicorn.Server):
    """uvicorn without its signal handling: ``serve_until_stopped`` decides when to stop and how long to drain."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve_until_stopped(
    app: FastAPI,
    sock: socket.socket,
    router: ClusterRouter,
    drain_s: float,
    on_ready: Callable[[int], None] = lambda port: None,
    *,
    log_level: str = "warning",
    lifespan: Literal["auto", "on", "off"] = "off",
) -> None:
    """Serve ``app`` until a signal, then drain (see the module contract)."""
    loop = asyncio.get_running_loop()
    stop, hurry = asyncio.Event(), asyncio.Event()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            hurry.set()
        stop.set()
        log.info("received %s", sig.name)

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)
    backstop = math.ceil(drain_s + DRAIN_GRACE_S)
    # httptools (C) rather than h11 parses the requests: less of the router's CPU on every request
    config = uvicorn.Config(
        app, http="httptools", log_level=log_level, lifespan=lifespan, timeout_graceful_shutdown=backstop
    )
    server = _Uvicorn(config)
    serving = loop.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started and not serving.done():
            await asyncio.sleep(0.01)
        if serving.done():
            serving.result()
            return
        on_ready(sock.getsockname()[1])
        if not await _first(serving, stop.wait()):
            serving.result()
            return
        log.info(
            "shutting down: %d requests in flight may run for up to %.1f s (a second signal ends them now)",
            router.in_flight,
            drain_s,
        )
        router.start_drain()
        server.should_exit = True
        if await _first(serving, hurry.wait(), timeout_s=drain_s) or not serving.done():
            if router.in_flight:
                log.warning(
                    "ending %d requests still in flight with a shutting_down error (drain bound %.1f s)",
                    router.in_flight,
                    drain_s,
                )
            router.end_drain()
        await serving
        log.info("HTTP server stopped")
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
        if not serving.done():
            serving.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await serving


async def _first(task: asyncio.Task[None], other: Coroutine[Any, Any, Any], timeout_s: float | None = None) -> bool:
    """Wait for ``task``, ``other`` or the timeout, whichever comes first; True when ``other`` finished."""
    waiter = asyncio.ensure_future(other)
    try:
        await asyncio.wait({task, waiter}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        return waiter.done()
    finally:
        waiter.cancel()
