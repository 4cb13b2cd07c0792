"""The two servers ``bench/engines.py`` compares: ``kvrelay serve`` and vLLM's OpenAI server, as child processes.

``start_kvrelay(spec)`` and ``start_vllm(spec)`` start one server each on a free loopback port and return an
``EngineServer`` at once; ``EngineServer.wait_ready(timeout)`` blocks until it answers a completion. Both
serve the same model directory under the same name, in the same dtype ``D`` (``ServerSpec.dtype``, bfloat16 by
default), with the same torch thread count:

- kvrelay: ``python -m kvrelay.cli.main serve --model DIR --dtype D --lanes N --kv-tokens K``, with
  ``OMP_NUM_THREADS`` set to the thread count (its device thread owns the torch pool).
- both: ``OMP_WAIT_POLICY=PASSIVE`` (kvrelay's own default; on a shared machine a spinning OpenMP thread holds
  a core its partner thread needs, docs/performance.md "OpenMP wait policy"), and ``GOMP_SPINCOUNT`` where
  ``omp_spincount`` sets it (a machine dedicated to the server: threads spin that many turns before they
  sleep), unless ``vllm_env`` says otherwise for vLLM.
- vLLM (its CPU build, in its own venv): ``-m vllm.entrypoints.openai.api_server --model DIR --dtype D
  --block-size 64`` with its CPU settings at their best for this work, after vLLM's CPU docs and
  ``vllm/platforms/cpu.py`` / ``vllm/utils/ompmultiprocessing.py``: the model runner's OpenMP threads are
  bound to cores ``0 .. threads-1`` (``VLLM_CPU_OMP_THREADS_BIND``; unbound with ``threads`` OpenMP threads
  where the process may not use that many cores), the engine core and API server keep one torch thread
  (vLLM sets that itself when ``OMP_NUM_THREADS`` is not forced), ``--max-num-seqs`` admits every stream at
  once, chunked prefill keeps ``--max-num-batched-tokens`` (default 2,048, vLLM's own), prefix caching is on
  (its default) with a checkpoint at every block for a model with sliding-window layers
  (``--prefix-cache-retention-interval 64``: by default vLLM 0.32 keeps those layers' KV only at a prompt's end
  and where two prompts part, so a cached prefix with a new suffix was recomputed whole; ``launch.vllm_server``),
  the KV cache is ``VLLM_CPU_KVCACHE_SPACE`` GiB (the KV tokens kvrelay gets, rounded up),
  and usage reports cached prompt tokens (``--enable-prompt-tokens-details``). vLLM preloads its own
  tcmalloc and torch's libgomp.

``wait_quiet(servers)`` blocks until no server's process tree has used more than ``QUIET_CORES`` of a core
over ``QUIET_WINDOW_S``: vLLM 0.32's CPU server keeps one core busy for about 1 s after every request
(measured: 0.9 to 1.1 cores in each 100 ms for 1.0 s after a cold prompt and after a 32-stream decode, then
0.0), so whichever server was measured right after it ran on one core for its first second (kvrelay's cold
TTFT 1.66 to 1.71 s right after a vLLM request against 1.39 to 1.43 s after 5 s of quiet). kvrelay's threads
sleep at once, so vLLM never met that.

``peak_rss_mib`` is the sum of the peak resident sets (``VmHWM``) of the server's process tree (vLLM runs an
API server, an engine core and a model runner; kvrelay one process). Linux only (``/proc``).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

from kvrelay.launch.vllm_server import VLLM_BLOCK_TOKENS, has_sliding_window
from kvrelay.testing.ports import free_port

QUIET_CORES = 0.05
"""A process tree using at most this share of one core over ``QUIET_WINDOW_S`` is quiet."""
QUIET_WINDOW_S = 0.2
"""The window ``wait_quiet`` measures each server's CPU time over."""

WAIT_POLICY = "PASSIVE"
"""Both servers' ``OMP_WAIT_POLICY`` (see the module docstring)."""


def omp_settings(spec: ServerSpec) -> dict[str, str]:
    """The OpenMP environment both servers get: the wait policy, and the spin count where ``spec`` sets one."""
    spin = {} if spec.omp_spincount is None else {"GOMP_SPINCOUNT": str(spec.omp_spincount)}
    return {"OMP_WAIT_POLICY": WAIT_POLICY, **spin}


@dataclass(frozen=True, slots=True)
class ServerSpec:
    """What both servers share: the model (its directory, the name it is served under), the torch threads,
    the concurrent sequences, the KV tokens and the work directory for logs and kvrelay's data."""

    model_dir: Path
    model_name: str
    kvrelay_model: str | None
    """What ``kvrelay serve --model`` gets (``None``: its default model, the one in ``model_dir``)."""
    threads: int
    lanes: int
    kv_tokens: int
    kv_bytes_per_token: int
    max_model_len: int
    work_dir: Path
    vllm_python: Path
    vllm_batched_tokens: int | None = None
    """``--max-num-batched-tokens`` (``None``: vLLM's default)."""
    vllm_force_omp_threads: bool = False
    """Also set ``OMP_NUM_THREADS`` for vLLM (its engine core and API server then keep that many torch threads)."""
    vllm_extra: tuple[str, ...] = ()
    """More vLLM flags (e.g. ``--enforce-eager`` for a smoke run)."""
    vllm_env: tuple[tuple[str, str], ...] = ()
    """More environment for vLLM (e.g. ``OMP_WAIT_POLICY``), set last."""
    omp_spincount: int | None = None
    """Both servers' ``GOMP_SPINCOUNT`` (``None``: unset, so passive threads sleep at once)."""
    dtype: str = "bfloat16"
    """Both servers' weights and KV (``float32`` where vLLM's bfloat16 path cannot run: a smoke run)."""


@dataclass
class EngineServer:
    """One running server: its name in the figures, base URL, the model name it serves, its child process
    and log file."""

    name: str
    url: str
    model_name: str
    process: subprocess.Popen[bytes]
    log: IO[bytes] = field(repr=False)
    version: str = ""

    @property
    def log_path(self) -> Path:
        return Path(self.log.name)

    def wait_ready(self, timeout_s: float) -> None:
        """Block until the server answers a one-token completion; ``RuntimeError`` with its log's tail if it
        exits first or does not answer within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        body = {"model": self.model_name, "prompt": [10, 11, 12], "max_tokens": 1, "temperature": 0}
        with httpx.Client(timeout=30.0) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"{self.name} exited with code {self.process.returncode} before it was ready; "
                        f"its log {self.log_path} ends:\n{tail(self.log_path)}"
                    )
                try:
                    if client.post(self.url + "/v1/completions", json=body).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(1.0)
        raise RuntimeError(
            f"{self.name} did not answer within {timeout_s:.0f} s; its log {self.log_path} ends:\n{tail(self.log_path)}"
        )

    def cpu_seconds(self) -> float:
        """User and system CPU seconds of the server's process tree so far (from ``/proc/*/stat``)."""
        return sum(_cpu_ticks(pid) for pid in process_tree(self.process.pid)) / os.sysconf("SC_CLK_TCK")

    def peak_rss_mib(self) -> float:
        """The summed peak resident sets of the server's process tree, MiB."""
        return sum(_peak_rss_kib(pid) for pid in process_tree(self.process.pid)) / 1024.0

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the server, then SIGKILL to its whole process group after ``timeout_s``; closes the log."""
        try:
            if self.process.poll() is None:
                self.process.terminate()
                try:
                    self.process.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    pass
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)  # stragglers of vLLM's process tree
            self.process.wait()
        finally:
            self.log.close()


def start_kvrelay(spec: ServerSpec) -> EngineServer:
    """``kvrelay serve`` on a free port (see the module docstring)."""
    port = free_port()
    argv = [sys.executable, "-m", "kvrelay.cli.main", "--log-level", "WARNING", "serve"]
    argv += ["--port", str(port), "--dtype", spec.dtype, "--lanes", str(spec.lanes)]
    argv += ["--kv-tokens", str(spec.kv_tokens), "--db", f"sqlite:///{spec.work_dir / 'facts.sqlite3'}"]
    if spec.kvrelay_model is not None:
        argv += ["--model", spec.kvrelay_model]
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(spec.threads),
        **omp_settings(spec),
        KVRELAY_DATA_DIR=str(spec.work_dir / "kvrelay-data"),
        PYTHONUNBUFFERED="1",
    )
    return _start("kvrelay", argv, env, port, spec)


def start_vllm(spec: ServerSpec) -> EngineServer:
    """vLLM's OpenAI server on a free port, with its CPU settings at their best (see the module docstring)."""
    port = free_port()
    argv = [str(spec.vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(spec.model_dir)]
    argv += ["--served-model-name", spec.model_name, "--dtype", spec.dtype, "--block-size", str(VLLM_BLOCK_TOKENS)]
    argv += ["--max-num-seqs", str(spec.lanes), "--max-model-len", str(spec.max_model_len)]
    argv += ["--enable-prompt-tokens-details", "--disable-uvicorn-access-log", "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--seed", "0"]
    if has_sliding_window(spec.model_dir):
        argv += ["--prefix-cache-retention-interval", str(VLLM_BLOCK_TOKENS)]  # a checkpoint every block
    if spec.vllm_batched_tokens is not None:
        argv += ["--max-num-batched-tokens", str(spec.vllm_batched_tokens)]
    argv += list(spec.vllm_extra)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "OMP_", "KMP_", "GOMP_"))}
    env.pop("PYTHONPATH", None)
    gib = math.ceil(spec.kv_tokens * spec.kv_bytes_per_token / 2**30)
    env.update(VLLM_CPU_KVCACHE_SPACE=str(max(1, gib)), PYTHONUNBUFFERED="1", VLLM_NO_USAGE_STATS="1")
    env.update(omp_settings(spec))
    env.update(HF_HUB_OFFLINE="1", DO_NOT_TRACK="1")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= spec.threads:
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in cores[: spec.threads])
    else:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        env["OMP_NUM_THREADS"] = str(spec.threads)
    if spec.vllm_force_omp_threads:
        env["OMP_NUM_THREADS"] = str(spec.threads)
    env.update(spec.vllm_env)
    server = _start("vllm", argv, env, port, spec)
    server.version = vllm_version(spec.vllm_python)
    return server


def _start(name: str, argv: list[str], env: dict[str, str], port: int, spec: ServerSpec) -> EngineServer:
    spec.work_dir.mkdir(parents=True, exist_ok=True)
    log = (spec.work_dir / f"{name}.log").open("wb")
    process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return EngineServer(name, f"http://127.0.0.1:{port}", spec.model_name, process, log)


def vllm_version(python: Path) -> str:
    """The installed vLLM's version, read from its package metadata files (without importing it)."""
    site = python.absolute().parent.parent / "lib"  # the venv's, not its base interpreter's
    for meta in sorted(site.glob("python3*/site-packages/vllm*.dist-info/METADATA")):
        match = re.search(r"^Version: (\S+)", meta.read_text(errors="replace"), re.MULTILINE)
        if match:
            return match.group(1)
    return "unknown"


def wait_quiet(servers: list[EngineServer], timeout_s: float = 10.0) -> float:
    """Block until every server's process tree was quiet over one ``QUIET_WINDOW_S`` (see the module
    docstring), at most ``timeout_s``; the seconds waited."""
    start = time.monotonic()
    while True:
        before = [s.cpu_seconds() for s in servers]
        time.sleep(QUIET_WINDOW_S)
        used = [s.cpu_seconds() - b for s, b in zip(servers, before, strict=True)]
        if max(used) <= QUIET_CORES * QUIET_WINDOW_S or time.monotonic() - start >= timeout_s:
            return time.monotonic() - start


def _cpu_ticks(pid: int) -> int:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])


def process_tree(root: int) -> list[int]:
    """``root`` and every live descendant of it (from ``/proc/*/stat``)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def _peak_rss_kib(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    match = re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE)
    return int(match.group(1)) if match else 0


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
