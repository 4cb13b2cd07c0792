"""A read-only probe inside a ``kvrelay worker`` process, for benchmarks.

``python -m kvrelay.cli.probed_worker WORKER-ARGS`` runs exactly
``kvrelay worker WORKER-ARGS``, except that once the worker's parts are built
(``launch.worker.build_worker``) a ``WorkerProbe`` observes them and
answers ``GET /probe`` (``/probe/pages``: without the interval lists) on a loopback port with JSON;
its URL is printed as
``kvrelay probe ready id=<worker id> url=<url>``. The probe changes no decision
of the worker; it only wraps two seams to time them:

- the restore handler (``controller.restorer.restore``): every restore's
  monotonic start and end and its restored bytes per tier (the worker's own
  ``RestoreReport``);
- the runtime's ``submit``: each job's submission, first and last token
  times, so a restore can be compared with the decode of the other lanes and
  a time to first token split into before and after the job reached the runtime.

A snapshot (taken on the worker's event loop, so it is consistent) holds the
page pool's counts, evictions by reason (``durable`` / ``lru`` from the pool;
``capacity`` counts of the ram and ssd tiers), bytes held per local tier,
running assignments, and the restore and decode intervals recorded so far.
Times are ``time.monotonic()``, one clock for every process of the machine.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvrelay.launch.worker_assembly import WorkerParts
from kvrelay.worker.runtime.jobs import Job, RuntimeEvent, TokenEvent

SNAPSHOT_TIMEOUT_S = 5.0


class _TimedRestore:
    """The worker's restore handler, with each call's interval and bytes recorded into ``log``."""

    def __init__(self, inner: Any, log: list[dict[str, Any]]) -> None:
        self._inner = inner
        self._log = log

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def restore(self, offer: Any, keys: Any, pages: Any) -> Any:
        start = time.monotonic()
        report = self._inner.restore(offer, keys, pages)
        self._log.append(
            {
                "start": start,
                "end": time.monotonic(),
                "request_id": offer.assignment.request_id,
                "bytes": dict(report.bytes_by_tier),
                "chunks": len(report.tiers),
            }
        )
        return report


class WorkerProbe:
    """Observes one worker's parts; ``snapshot()`` must run on the worker's event loop."""

    def __init__(self, parts: WorkerParts, loop: asyncio.AbstractEventLoop) -> None:
        self.parts = parts
        self.loop = loop
        self.restores: list[dict[str, Any]] = []
        self.jobs: list[list[float]] = []
        """Per submitted job: [submitted, first token time, last token time, tokens] (the last three once it has
        a token)."""
        self._evictions: Counter[str] = Counter()
        self._evictions_seen = 0
        controller = parts.controller
        if controller.restorer is not None:
            controller.restorer = _TimedRestore(controller.restorer, self.restores)
        submit = parts.runtime.submit

        def timed_submit(
            job: Job, on_event: Callable[[RuntimeEvent], None] | None = None, timeout: float | None = None
        ) -> Any:
            times: list[float] = [time.monotonic()]
            self.jobs.append(times)

            def observe(event: RuntimeEvent) -> None:
                if isinstance(event, TokenEvent):
                    now = time.monotonic()
                    if len(times) > 1:
                        times[2], times[3] = now, times[3] + 1
                    else:
                        times.extend((now, now, 1))
                if on_event is not None:
                    on_event(event)

            return submit(job, observe, timeout)

        parts.runtime.submit = timed_submit  # type: ignore[method-assign]
        self._server: ThreadingHTTPServer | None = None

    def snapshot(self, full: bool = True) -> dict[str, Any]:
        """Pages, evictions, tier bytes, running work and (``full``) restores and decode intervals."""
        pool = self.parts.pool
        if len(pool.evictions) < self._evictions_seen:  # the owner drained the list
            self._evictions_seen = 0
        for ev in pool.evictions[self._evictions_seen :]:
            self._evictions[ev.reason] += 1
        self._evictions_seen = len(pool.evictions)
        controller = self.parts.controller
        stack = getattr(controller.restorer, "stack", None)
        tiers = stack.local_tiers if stack is not None else ()
        evictions = {f"gpu:{reason}": n for reason, n in self._evictions.items()}
        evictions |= {f"{t.name}:capacity": t.counters().evictions for t in tiers}
        snap = {
            "time": time.monotonic(),
            "worker_id": controller.worker_id,
            "epoch": controller.epoch,
            "pages": {
                "total": pool.num_pages,
                "free": pool.num_free,
                "cached": pool.num_cached,
                "referenced": pool.num_referenced,
                "reserved": pool.num_reserved,
            },
            "evictions": evictions,
            "tier_bytes": {t.name: t.used_bytes for t in tiers},
            "running": len(controller.runs),
            "kv_bytes_per_token": controller.kv_bytes_per_token,
        }
        if full:
            snap["restores"] = list(self.restores)
            snap["decode"] = [list(t) for t in self.jobs if len(t) > 1]
        return snap

    def start(self, host: str = "127.0.0.1") -> str:
        """Serve ``GET /probe`` on a free loopback port; the URL."""
        probe = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path not in ("/probe", "/probe/pages"):
                    self.send_error(404, "only /probe and /probe/pages are served")
                    return
                full = self.path == "/probe"
                try:
                    future = asyncio.run_coroutine_threadsafe(_call(lambda: probe.snapshot(full)), probe.loop)
                    body = json.dumps(future.result(SNAPSHOT_TIMEOUT_S)).encode()
                except (RuntimeError, TimeoutError) as exc:  # the worker's loop is stopping
                    self.send_error(503, f"the worker is stopping: {exc!r}")
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                return

        self._server = ThreadingHTTPServer((host, 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="kvrelay-probe", daemon=True).start()
        return f"http://{host}:{self._server.server_address[1]}"


async def _call(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    return fn()
