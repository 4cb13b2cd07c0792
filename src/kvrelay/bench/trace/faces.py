"""The serving setups a trace replay compares, each started as real processes on loopback.

- ``kvrelay_cluster(policy)``: ``kvrelay cluster --workers 2`` (a router process and
  two worker processes) with the router's policy set through ``$KVRELAY_POLICY``
  (``kvrelay`` or ``round_robin``).
- ``serve_workers`` then ``start_peer(peer, policy)``: two ``kvrelay serve`` processes (each an embedded
  router plus one worker: a plain OpenAI HTTP face per worker) behind a real peer router
  (``kvrelay.bench.trace.peers``: SGLang Model Gateway, vLLM's router, sglang-router) with ``--policy <policy>``.

Every setup gets a fresh home (its own data directory: fact store and chunk
files start empty, so every setup starts cold; the model cache is shared),
``OMP_NUM_THREADS`` threads per process, and the same model, dtype, KV
capacity and lanes per worker. ``Face.stop`` sends SIGTERM to each process it
started, then kills what is still alive after ``grace_s``. Process output goes
to log files under the home, named in errors.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvrelay.bench.trace.peers import Peer, peer_argv
from kvrelay.launch import defaults
from kvrelay.testing.ports import free_port

CLUSTER_READY = "kvrelay cluster ready"


@dataclass(frozen=True, slots=True)
class FaceOptions:
    model: str | None = None
    """Model directory or GGUF file; None: the default Gemma 3 270M."""
    dtype: str = defaults.DTYPE
    kv_tokens: int = defaults.KV_TOKENS
    lanes: int = defaults.LANES
    threads: int = 1
    """Torch threads per worker process (``OMP_NUM_THREADS``)."""
    workers: int = 2


@dataclass
class Face:
    """A running setup: its base URL and the processes behind it."""

    name: str
    url: str
    home: Path
    processes: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)
    engine_pids: tuple[int, ...] = ()
    """Engines this face routes to that it did not start (shared vLLM servers): counted as workers."""

    def alive(self) -> bool:
        return all(p.poll() is None for _, p in self.processes)

    def logs(self) -> str:
        return ", ".join(str(self.home / f"{name}.log") for name, _ in self.processes)

    def exit_report(self, lines: int = 30) -> str:
        """Each started process that has exited: its name, exit code and the last ``lines`` lines of its log
        (empty while all run)."""
        parts = []
        for name, p in self.processes:
            if p.poll() is None:
                continue
            path = self.home / f"{name}.log"
            tail = path.read_text(errors="replace").splitlines()[-lines:] if path.is_file() else []
            parts.append(f"{name} exited with code {p.returncode}; the end of {path}:\n" + "\n".join(tail))
        return "\n".join(parts)

    def check_running(self, waiting_for: str) -> None:
        """``RuntimeError`` naming ``waiting_for`` with the exit report where one of the face's processes exited."""
        if not self.alive():
            raise RuntimeError(f"{waiting_for} stopped before it was ready: {self.exit_report()}")

    def log_has(self, name: str, text: str) -> bool:
        """Whether process ``name``'s log holds ``text`` yet."""
        path = self.home / f"{name}.log"
        return path.is_file() and text in path.read_text(errors="replace")

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds (user + system) used so far by each started process and its descendants, by role."""
        out: dict[str, float] = {}
        for name, p in self.processes:
            for pid in descendants(p.pid):
                role = _role(pid) or name
                out[role] = out.get(role, 0.0) + _cpu(pid)
        return out

    def sched_seconds(self) -> tuple[float, float]:
        """Seconds the worker processes' threads (and the engines') ran on a CPU and waited runnable for one
        (``/proc`` schedstat)."""
        pids = [pid for _, p in self.processes for pid in descendants(p.pid)]
        workers = [pid for pid in pids if (_role(pid) or "").startswith(("worker", "serve", "engine"))]
        workers += [pid for engine in self.engine_pids for pid in descendants(engine)]
        run = wait = 0.0
        for pid in workers:
            r, w = sched_of(pid)
            run, wait = run + r, wait + w
        return run, wait

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM every started process; after ``grace_s``, SIGKILL the process group of any still alive (a
        ``kvrelay cluster``'s workers with it)."""
        for _, p in reversed(self.processes):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for _, p in reversed(self.processes):
            try:
                p.wait(grace_s)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        try:
            for task in Path(f"/proc/{current}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def sched_of(pid: int) -> tuple[float, float]:
    """Seconds all threads of ``pid`` ran on a CPU and waited on a run queue (0, 0 when it is gone)."""
    run = wait = 0
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            fields = (task / "schedstat").read_text().split()
            run, wait = run + int(fields[0]), wait + int(fields[1])
    except OSError:
        pass
    return run / 1e9, wait / 1e9


def _cpu(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _role(pid: int) -> str | None:
    """``router``, ``worker w1``, ``serve``, ``cluster``... from a kvrelay process's command line; ``engine`` for a
    vLLM engine core (a router's ``--vllm-in-process`` child)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    if argv[0].startswith("VLLM::"):
        return "engine"
    for command in ("router", "worker", "serve", "cluster"):
        if command in argv:
            return f"{command} {argv[argv.index('--worker-id') + 1]}" if "--worker-id" in argv else command
    return None


def process_env(home: Path, threads: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVRELAY_")}
    cache = os.environ.get("KVRELAY_CACHE_DIR")
    if cache:
        env["KVRELAY_CACHE_DIR"] = cache
    env.update(
        KVRELAY_DATA_DIR=str(home / "data"),
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        PYTHONUNBUFFERED="1",
        **extra,
    )
    return env


def spawn(face: Face, name: str, argv: list[str], env: dict[str, str]) -> None:
    """Start ``argv`` as one of the face's processes, in a process group of its own, output to ``<name>.log``."""
    with (face.home / f"{name}.log").open("wb") as log:
        child = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        face.processes.append((name, child))


def kvrelay_argv(command: str, *args: str, python: str = sys.executable) -> list[str]:
    return [python, "-m", "kvrelay.cli.main", command, *args]


def _model_flags(options: FaceOptions) -> list[str]:
    flags = ["--dtype", options.dtype, "--kv-tokens", str(options.kv_tokens), "--lanes", str(options.lanes)]
    return (["--model", options.model] if options.model else []) + flags


def kvrelay_cluster(name: str, policy: str, options: FaceOptions, home: Path) -> Face:
    """``kvrelay cluster`` with the router policy ``policy``; it is ready when ``log_has("cluster", CLUSTER_READY)``."""
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    face = Face(name, f"http://127.0.0.1:{port}", home)
    spawn(
        face,
        "cluster",
        kvrelay_argv("cluster", "--workers", str(options.workers), "--port", str(port), *_model_flags(options)),
        process_env(home, options.threads, KVRELAY_POLICY=policy),
    )
    return face


def serve_workers(name: str, options: FaceOptions, home: Path) -> tuple[Face, list[str]]:
    """One ``kvrelay serve`` process per worker; once they answer, the caller runs ``start_peer``.

    Returns the face (its URL is the port the peer router will listen on) and the workers' URLs.
    """
    home.mkdir(parents=True, exist_ok=True)
    face = Face(name, f"http://127.0.0.1:{free_port()}", home)
    urls: list[str] = []
    for i in range(options.workers):
        port = free_port()
        urls.append(f"http://127.0.0.1:{port}")
        spawn(
            face,
            f"serve{i}",
            kvrelay_argv("serve", "--port", str(port), *_model_flags(options)),
            process_env(home / f"serve{i}", options.threads),
        )
    return face, urls


def start_peer(face: Face, peer: Peer, executable: str, policy: str, worker_urls: list[str]) -> None:
    """Start the peer router ``peer`` with ``policy`` in front of ``worker_urls`` on the face's port."""
    port = int(face.url.rsplit(":", 1)[1])
    argv = peer_argv(peer, executable, policy, port, free_port(), worker_urls)
    spawn(face, peer.value, argv, process_env(face.home, 1))


async def until(probe: Callable[[], bool], face: Face, limit_s: float) -> None:
    """Poll ``probe`` until it holds; ``RuntimeError`` naming the face's logs if a process exits or ``limit_s``
    passes first."""
    deadline = time.monotonic() + limit_s
    while not probe():
        face.check_running(face.name)
        if time.monotonic() > deadline:
            raise RuntimeError(f"{face.name} was not ready within {limit_s:.0f} s; logs: {face.logs()}")
        await asyncio.sleep(0.2)
