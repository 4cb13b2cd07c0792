"""``kvrelay cluster``: a supervisor that runs one router and N worker child processes on this machine.

Contract:
- With ``engines`` (``kvrelay cluster --engine vllm``), one vLLM server per
  worker starts first (all at once, in process groups of their own, logs under
  the data directory's ``vllm/``); once each answers its health check, worker
  i runs ``--engine vllm`` against server i. Engines stop after the workers.
- The router child starts first (``python -m kvrelay.cli.main router ...``); once it
  prints its ready line, N worker children start, each named on its command
  line (``kvrelay.cli.main worker --worker-id w1 --router ws://.../workers ...``).
  ``on_ready(http_url, worker_ids)`` is called when every worker has printed its
  ready line. Children inherit stderr (their logs); their ready lines are
  forwarded to this process's stdout.
- Without a configured shared secret, the supervisor makes a random one and
  hands it to its children in ``$KVRELAY_SECRET``.
- On SIGINT/SIGTERM (or when the router child exits) the workers get SIGTERM
  first (they drain within their grace period), then the router; a child still
  alive ``grace_s + 15`` seconds later is killed. A worker that exits on its
  own is logged, not restarted. ``run_cluster`` returns once every child has
  exited.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvrelay.launch import defaults
from kvrelay.launch.child import ChildProcess, ChildTimeout
from kvrelay.launch.vllm_server import VllmServer, VllmServerSpec, VllmStartError
from kvrelay.paths import data_dir
from kvrelay.transport.auth import SECRET_ENV_VAR, SecretError, load_secret

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 300.0
ROUTER_READY = re.compile(r"kvrelay router ready http=(\S+) workers=(\S+)")
WORKER_READY = re.compile(r"kvrelay worker ready id=(\S+)")


@dataclass(frozen=True, slots=True)
class ClusterOptions:
    workers: int = 2
    host: str = defaults.HOST
    port: int = defaults.HTTP_PORT
    worker_port: int = 0
    router_args: tuple[str, ...] = ()
    """Further flags for the router child (model, db, timeouts, config file)."""
    worker_args: tuple[str, ...] = ()
    """Further flags for every worker child (model, dtype, sizes, config file)."""
    grace_s: float = defaults.GRACE_S
    engines: tuple[VllmServerSpec, ...] = ()
    """One vLLM server per worker (``--engine vllm``), or none: native workers."""


def child_argv(command: str, args: Sequence[str]) -> list[str]:
    """The command line of a child running ``kvrelay <command> <args>`` with this interpreter."""
    return [sys.executable, "-m", "kvrelay.cli.main", command, *args]


def run_cluster(options: ClusterOptions, on_ready: Callable[[str, list[str]], None] = lambda u, w: None) -> int:
    """Run the router and workers until SIGINT/SIGTERM or the router's exit; the router's exit code."""
    if options.workers < 1:
        raise ValueError(f"--workers {options.workers}: a cluster needs at least 1 worker")
    if options.engines and len(options.engines) != options.workers:
        raise ValueError(f"{len(options.engines)} engines for {options.workers} workers; give one per worker")
    env = dict(os.environ)
    try:
        load_secret()
    except SecretError:
        env[SECRET_ENV_VAR] = secrets.token_urlsafe(32)
        log.info("no shared secret configured; the cluster's children share a random one")
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda s, f: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    children: list[ChildProcess] = []
    engines = [VllmServer(spec, data_dir() / "vllm" / f"engine-{spec.port}.log") for spec in options.engines]
    try:
        for engine in engines:
            engine.start()
        for i, engine in enumerate(engines, 1):
            log.info("w%d's vLLM engine: %s, KV events %s", i, engine.spec.url, engine.spec.events_url)
        try:
            for engine in engines:
                engine.wait_ready(stop=stop)
        except VllmStartError as exc:
            if stop.is_set():
                return 0
            log.error("%s", exc)
            return 1
        router = ChildProcess(
            "router",
            child_argv(
                "router",
                [
                    "--host",
                    options.host,
                    "--port",
                    str(options.port),
                    "--worker-port",
                    str(options.worker_port),
                    *options.router_args,
                ],
            ),
            env,
            stderr=None,
            echo=True,
        )
        children.append(router)
        router_ready = _wait_ready(router, ROUTER_READY, stop)
        if router_ready is None:
            return _stop_all(children, options.grace_s) or 1
        http_url, workers_url = router_ready.group(1), router_ready.group(2)
        workers = [
            ChildProcess(
                f"w{i}",
                child_argv(
                    "worker",
                    [
                        "--worker-id",
                        f"w{i}",
                        "--router",
                        workers_url,
                        "--grace-s",
                        str(options.grace_s),
                        *options.worker_args,
                        *(_engine_args(engines[i - 1].spec) if engines else ()),
                    ],
                ),
                env,
                stderr=None,
                echo=True,
            )
            for i in range(1, options.workers + 1)
        ]
        children.extend(workers)
        ready = [w.name for w in workers if _wait_ready(w, WORKER_READY, stop) is not None]
        if len(ready) == len(workers) and not stop.is_set():
            on_ready(http_url, ready)
        reported: set[str] = set()
        while not stop.wait(0.5) and router.process.poll() is None:
            for worker in workers:
                code = worker.process.poll()
                if code is not None and worker.name not in reported:
                    reported.add(worker.name)
                    log.warning("worker %s exited with code %s; it is not restarted", worker.name, code)
        return _stop_all(children, options.grace_s)
    finally:
        for child in children:
            if child.process.poll() is None:
                child.process.kill()
                child.process.wait()
        for engine in engines:
            engine.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _engine_args(spec: VllmServerSpec) -> list[str]:
    return ["--engine", "vllm", "--engine-url", spec.url, "--kv-events", spec.events_url, "--model", spec.model]


def _wait_ready(child: ChildProcess, pattern: re.Pattern[str], stop: threading.Event) -> re.Match[str] | None:
    """The child's ready line; None once ``stop`` is set, the child has exited, or ``READY_TIMEOUT_S`` passed."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not stop.is_set() and time.monotonic() < deadline:
        try:
            return child.wait_for(pattern, 0.25)
        except ChildTimeout:
            if child.process.poll() is not None:
                return None
    return None


def _stop_all(children: list[ChildProcess], grace_s: float) -> int:
    """SIGTERM the workers, wait, then the router; kill what outlives its deadline. The router's exit code."""
    workers, router = children[1:], children[0]
    for group in (workers, [router]):
        for child in group:
            child.signal(signal.SIGTERM)
        for child in group:
            try:
                child.process.wait(timeout=grace_s + 15.0)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0f s; killing it", child.name, grace_s + 15.0)
                child.process.kill()
                child.process.wait()
    code = router.process.returncode
    return 0 if code in (0, -signal.SIGTERM) else int(code)
