"""``kvrelay cluster``: a supervisor that runs one router and N worker child processes on this machine.

Contract:
- With ``engines`` (``kvrelay cluster --engine vllm``), one vLLM server per worker starts first (all at once,
  in process groups of their own, logs under the data directory's ``vllm/``); once each answers its health
  check, the router child drives them from its own process (``kvrelay router --vllm-engine URL,KV_EVENTS``
  per engine: workers ``v1`` .. ``vN`` in the router's process, no worker children; docs/design.md section 13
  says why). Engines stop after the router; they are not restarted. With ``in_process`` (``--engine
  vllm-in-process``) no server starts: the router child, run by the engines' Python, builds their engines in
  its own process (``kvrelay router --vllm-in-process N``; docs/design.md section 13).
- The router child starts first (``python -m kvrelay.cli.main router ...``); once it prints its ready line,
  N worker children start, each named on its command line (``kvrelay.cli.main worker --worker-id w1 --router
  ws://.../workers ...``). ``on_ready(http_url, worker_ids)`` is called when every worker has printed its
  ready line (with engines: when the router has). Children inherit stderr (their logs); their output lines are
  forwarded to this process's stdout.
- Without a configured shared secret, the supervisor makes a random one and hands it to its children in
  ``$KVRELAY_SECRET``. The children end (SIGTERM, their graceful stop) when the supervisor dies, even by
  SIGKILL (``launch.child.follow_parent``).
- A child that exits on its own is restarted by the rule of ``launch.restarts``: with its command line, the
  router on the ports it first bound (so clients and workers find it again), after a growing delay, at most
  ``restarts.max_restarts`` times within ``restarts.window_s``. Every exit is logged at error level, naming
  the child, its exit status and what the supervisor does now; a child that is not restarted is named with
  why (it stopped cleanly, or it keeps crashing). Without a router the cluster stops (``run_cluster`` returns
  1); without a worker it runs on with the others.
- On SIGINT/SIGTERM nothing is restarted any more, and the cluster stops in an order that loses nothing:
  first the router, which drains (no new request; running streams go on, their workers still up, for up to
  ``drain_s``; then each ends with an error event that says why), then the workers, which have nothing left
  to hand over. A child still alive after its deadline (the router: ``drain_s + 20``; a worker: ``grace_s +
  15`` seconds) is killed. ``run_cluster`` returns 0 when the router stopped cleanly.
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
from dataclasses import dataclass, field

from kvrelay.launch import defaults
from kvrelay.launch.child import PARENT_PID_ENV, ChildProcess, ChildTimeout
from kvrelay.launch.restarts import RestartPolicy, Verdict, decide, describe_exit
from kvrelay.launch.vllm_server import (
    VllmServer,
    VllmServerSpec,
    VllmStartError,
    attached_router_flags,
    in_process_router_flags,
)
from kvrelay.paths import data_dir
from kvrelay.transport.auth import SECRET_ENV_VAR, SecretError, load_secret

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 300.0
POLL_S = 0.2
ROUTER_READY = re.compile(r"kvrelay router ready http=(\S+) workers=(\S+)")
WORKER_READY = re.compile(r"kvrelay worker ready id=(\S+)")
_PORT = re.compile(r":(\d+)(?:/|$)")
STATUS_URL = re.compile(r" status=(\S+)")
"""The read-only status URL in a router's or worker's ready line (``launch/status.py``)."""


def status_url(ready_line: str) -> str:
    """The status listener's URL named in a router's or worker's ready line."""
    found = STATUS_URL.search(ready_line)
    if found is None:
        raise ValueError(f"no status URL in the ready line {ready_line!r}")
    return found.group(1)


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
    """One vLLM server per worker (``--engine vllm``; the router drives them), or none: native worker children."""
    in_process: bool = False
    """Run the ``engines``' engines in the router's process instead of starting their servers (``--engine
    vllm-in-process``; the router child runs from their venv)."""
    drain_s: float = defaults.DRAIN_S
    restarts: RestartPolicy = field(default_factory=RestartPolicy)


def child_argv(command: str, args: Sequence[str], python: str = sys.executable) -> list[str]:
    """The command line of a child running ``kvrelay <command> <args>`` with ``python`` (this interpreter)."""
    return [python, "-m", "kvrelay.cli.main", command, *args]


@dataclass
class _Supervised:
    """One child the supervisor keeps running: how to start it, its process, and its restarts."""

    label: str
    argv: list[str]
    ready: re.Pattern[str]
    env: dict[str, str]
    child: ChildProcess = field(init=False)
    restarts: list[float] = field(default_factory=list)
    restart_at: float | None = None
    back_after: int | None = None
    """While a restarted child has not printed its ready line: the line mark it was restarted at."""
    given_up: bool = False

    def __post_init__(self) -> None:
        self.start()

    def start(self) -> None:
        self.child = ChildProcess(self.label.split()[-1], self.argv, self.env, stderr=None, echo=True)

    @property
    def running(self) -> bool:
        return self.child.process.poll() is None


def run_cluster(options: ClusterOptions, on_ready: Callable[[str, list[str]], None] = lambda u, w: None) -> int:
    """Run and supervise the router and workers until SIGINT/SIGTERM (see the module contract)."""
    if options.workers < 1:
        raise ValueError(f"--workers {options.workers}: a cluster needs at least 1 worker")
    if options.engines and len(options.engines) != options.workers:
        raise ValueError(f"{len(options.engines)} engines for {options.workers} workers; give one per worker")
    env = {**os.environ, PARENT_PID_ENV: str(os.getpid())}  # the children end with this supervisor
    try:
        load_secret()
    except SecretError:
        env[SECRET_ENV_VAR] = secrets.token_urlsafe(32)
        log.info("no shared secret configured; the cluster's children share a random one")
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda s, f: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    children: list[_Supervised] = []
    servers = () if options.in_process else options.engines
    engines = [VllmServer(spec, data_dir() / "vllm" / f"engine-{spec.port}.log") for spec in servers]
    try:
        for engine in engines:
            engine.start()
        for i, engine in enumerate(engines, 1):
            log.info("v%d's vLLM engine: %s, KV events %s", i, engine.spec.url, engine.spec.events_url)
        try:
            for engine in engines:
                engine.wait_ready(stop=stop)
        except VllmStartError as exc:
            if stop.is_set():
                return 0
            log.error("%s", exc)
            return 1
        router = _Supervised("router", _router_argv(options, options.port, options.worker_port), ROUTER_READY, env)
        children.append(router)
        ready = _wait_ready(router.child, ROUTER_READY, stop)
        if ready is None:
            if not stop.is_set():
                log.error("kvrelay cluster: the router did not start (%s); stopping", _status(router.child))
            return _stop_all(router, [], options) or 1
        http_url, workers_url = ready.group(1), ready.group(2)
        router.argv = _router_argv(options, _port_of(http_url), _port_of(workers_url))  # restarts keep the ports
        workers = [
            _Supervised(f"worker w{i}", child_argv("worker", _worker_args(options, i, workers_url)), WORKER_READY, env)
            for i in range(1, 0 if options.engines else options.workers + 1)
        ]
        children.extend(workers)
        named = [w.label.split()[-1] for w in workers if _wait_ready(w.child, WORKER_READY, stop) is not None]
        if len(named) == len(workers) and not stop.is_set():
            on_ready(http_url, named or [f"v{i}" for i in range(1, len(options.engines) + 1)])
        while not stop.wait(POLL_S):
            if not _supervise(router, workers, options.restarts):
                _stop_all(router, workers, options)
                return 1
        return _stop_all(router, workers, options)
    finally:
        for supervised in children:
            if supervised.running:
                supervised.child.process.kill()
                supervised.child.process.wait()
        for engine in engines:
            engine.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _supervise(router: _Supervised, workers: list[_Supervised], policy: RestartPolicy) -> bool:
    """One look at every child: restart what is due, decide on what exited. False once no router is left."""
    now = time.monotonic()
    for supervised in (router, *workers):
        if supervised.given_up:
            continue
        if supervised.restart_at is not None:
            if now >= supervised.restart_at:
                supervised.restart_at = None
                supervised.start()
                supervised.back_after = 0
                log.warning("kvrelay cluster: %s restarted (pid %d)", supervised.label, supervised.child.pid)
            continue
        if supervised.back_after is not None:
            try:
                line = supervised.child.wait_for(supervised.ready, 0, supervised.back_after)
                log.warning("kvrelay cluster: %s is back: %s", supervised.label, line.group(0))
                supervised.back_after = None
            except ChildTimeout:
                pass
        code = supervised.child.process.poll()
        if code is not None:
            _on_exit(supervised, code, now, policy, sum(1 for w in workers if not w.given_up))
    return not router.given_up


def _on_exit(supervised: _Supervised, code: int, now: float, policy: RestartPolicy, workers_left: int) -> None:
    decision = decide(code, supervised.restarts, now, policy)
    status = describe_exit(code)
    label = supervised.label
    if decision.verdict is Verdict.RESTART:
        supervised.restarts.append(now)
        supervised.restart_at = now + decision.delay_s
        log.error(
            "kvrelay cluster: %s exited with %s; restarting it in %.1f s (restart %d of at most %d within %.0f s)",
            label,
            status,
            decision.delay_s,
            decision.recent + 1,
            policy.max_restarts,
            policy.window_s,
        )
        return
    supervised.given_up = True
    if decision.verdict is Verdict.CLEAN_EXIT:
        why = "it stopped cleanly (someone stopped it on purpose)"
    else:
        why = f"it was restarted {decision.recent} times within {policy.window_s:.0f} s and keeps exiting"
    if label == "router":
        log.error("kvrelay cluster: router exited with %s; not restarting it: %s; stopping the cluster", status, why)
    else:
        log.error(
            "kvrelay cluster: %s exited with %s; not restarting it: %s; the cluster runs on with %d workers",
            label,
            status,
            why,
            workers_left - 1,
        )


def _router_argv(options: ClusterOptions, port: int, worker_port: int) -> list[str]:
    args = ["--host", options.host, "--port", str(port), "--worker-port", str(worker_port)]
    args = [*args, "--drain-s", str(options.drain_s), *options.router_args]
    if options.in_process and options.engines:
        return child_argv("router", [*args, *in_process_router_flags(options.engines)], options.engines[0].python)
    return child_argv("router", [*args, *attached_router_flags(options.engines)])


def _worker_args(options: ClusterOptions, i: int, workers_url: str) -> list[str]:
    return ["--worker-id", f"w{i}", "--router", workers_url, "--grace-s", str(options.grace_s), *options.worker_args]


def _port_of(url: str) -> int:
    match = _PORT.search(url)
    if match is None:
        raise ValueError(f"no port in the router's URL {url!r}")
    return int(match.group(1))


def _status(child: ChildProcess) -> str:
    code = child.process.poll()
    return f"no ready line within {READY_TIMEOUT_S:.0f} s" if code is None else f"exited with {describe_exit(code)}"


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


def _stop_all(router: _Supervised, workers: list[_Supervised], options: ClusterOptions) -> int:
    """SIGTERM the router and wait for its drain, then the workers; kill what outlives its deadline.

    0 when the router stopped cleanly, else its exit code (1 if it was killed by a signal).
    """
    for group, deadline_s in (([router], options.drain_s + 20.0), (workers, options.grace_s + 15.0)):
        for supervised in group:
            supervised.child.signal(signal.SIGTERM)
        for supervised in group:
            try:
                supervised.child.process.wait(timeout=deadline_s)
            except subprocess.TimeoutExpired:
                log.error("kvrelay cluster: %s did not stop within %.0f s; killing it", supervised.label, deadline_s)
                supervised.child.process.kill()
                supervised.child.process.wait()
    code = router.child.process.returncode
    return 0 if code in (0, -signal.SIGTERM) else (code if code > 0 else 1)
