"""A vLLM OpenAI server as a child process: its command line, start, readiness, kill and stop.

Contract:
- ``VllmServerSpec.argv`` runs ``VENV/bin/python -m vllm.entrypoints.openai.api_server``
  (vLLM's ``vllm`` console script does not start from its CPU build's venv) on
  ``host:port`` with prefix caching, token-id prompts' cached-token counts
  (``--enable-prompt-tokens-details``), the KV block size kvrelay routes by
  (``block_tokens``: vLLM's CPU attention takes multiples of 32), and KV
  events published on ZMQ at ``tcp://*:EVENTS_PORT`` (vLLM binds an endpoint
  with a wildcard and connects to any other). ``kv_cache_bytes`` sizes its KV
  cache (vLLM rounds it down to whole blocks); ``eager`` skips torch.compile,
  and with an explicit KV size vLLM then skips its warm-up too (start-up is
  the cost of a test). ``uniprocess`` runs the model in the engine core's
  process (see the field). For a model with sliding-window layers (``has_sliding_window``) every block
  boundary is made a prefix-cache checkpoint (``--prefix-cache-retention-interval`` = ``block_tokens``):
  vLLM 0.32's default (0) keeps those layers' KV only at "semantic checkpoints" (a prompt's end, a junction
  where two cached prompts part), so a prompt that shares a cached prompt's first blocks and parts from it
  elsewhere recomputes them all, while kvrelay's router, like every peer's, counts a shared prefix as a
  hit at any block boundary (docs/design.md section 13).
- ``vllm_python(explicit)`` finds the interpreter of vLLM's venv: the explicit
  path, ``$KVRELAY_VLLM_PYTHON``, ``.venv-vllm`` in the working directory, or
  ``.venv-vllm`` at the root of this source tree; else ``VllmNotInstalled``
  naming the fix (``make vllm``).
- ``VllmServer`` starts the child in a process group of its own, with stdout
  and stderr to ``log_path``. ``wait_ready(timeout)`` polls ``GET /health`` until
  it answers 200 and fails early, with the log's tail, if the child exits (or
  at once when the caller's ``stop`` event is set).
  ``kill()`` sends SIGKILL to the group (what a crash looks like); ``stop()``
  sends SIGTERM, then SIGKILL after ``timeout``; ``start()`` again after either
  restarts it on the same ports.
- ``loopback_specs`` builds a cluster's alike servers on free loopback ports; ``worker_engine_flags`` and
  ``attached_router_flags`` are the ``kvrelay worker`` and ``kvrelay router`` flags that serve through them,
  ``in_process_router_flags`` those of a router that runs their engines in its own process instead.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvrelay.engines.vllm.metrics import EngineFigures
from kvrelay.launch.ports import free_port
from kvrelay.models.config import ModelConfig

VLLM_PYTHON_ENV = "KVRELAY_VLLM_PYTHON"
VLLM_VENV = ".venv-vllm"
READY_TIMEOUT_S = 300.0


class VllmNotInstalled(RuntimeError):
    """No interpreter of vLLM's venv was found."""


class VllmStartError(RuntimeError):
    """A vLLM server exited, or did not answer its health check, before it was ready."""


def vllm_python(explicit: str | None = None) -> str:
    """The Python of vLLM's venv (see the module contract)."""
    candidates = [explicit, os.environ.get(VLLM_PYTHON_ENV)]
    candidates += [str(Path.cwd() / VLLM_VENV / "bin" / "python")]
    candidates += [str(Path(__file__).resolve().parents[3] / VLLM_VENV / "bin" / "python")]
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return candidate
    raise VllmNotInstalled(
        f"no vLLM interpreter found (looked at --vllm-python, ${VLLM_PYTHON_ENV}, ./{VLLM_VENV}); "
        f"run `make vllm` in the kvrelay checkout, or pass --vllm-python PATH/TO/VENV/bin/python"
    )


UNIPROCESS_ARGS = ("--distributed-executor-backend", "uni")
"""vLLM's arguments that run the model in the engine core's process (``VllmServerSpec.uniprocess``)."""
UNIPROCESS_ENV = (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),)
"""The environment without which vLLM's CPU platform turns ``UNIPROCESS_ARGS`` back into its multiprocess executor."""
VLLM_BLOCK_TOKENS = 64
"""vLLM's KV block size (``--block-size``) for kvrelay's engines: kvrelay's default chunk, a multiple of 32 as
vLLM's CPU attention needs."""


@dataclass(frozen=True, slots=True)
class VllmServerSpec:
    """One vLLM OpenAI server: model, address, KV event port, dtype and sizes."""

    model: str
    port: int
    events_port: int
    python: str
    host: str = "127.0.0.1"
    served_name: str | None = None
    dtype: str = "bfloat16"
    block_tokens: int = VLLM_BLOCK_TOKENS
    max_model_len: int | None = None
    kv_cache_bytes: int | None = None
    max_num_seqs: int | None = None
    threads: int = 1
    """Torch threads of the engine (vLLM drops to 1 unless ``OMP_NUM_THREADS`` is set)."""
    eager: bool = True
    uniprocess: bool = True
    """Run the model in the engine core's process (``--distributed-executor-backend uni``), not in a model-runner
    process of its own, vLLM's CPU default. There the engine core and the model runner pass every step through
    shared-memory queues whose readers busy-poll (``sched_yield``) for 1 s after each message
    (``vllm/distributed/device_communicators/shm_broadcast.py``, ``SpinCondition.busy_loop_s``): an engine that
    serves a request a second keeps two processes on a core each, beside the one its forward needs (measured
    here: 120 tiny-model requests in bursts of 6 took 3.18 s against 2.25 s in one process, and the model
    runner held a core for a second after the last). ``vllm/platforms/cpu.py`` forces the multiprocess executor
    unless ``VLLM_ENABLE_V1_MULTIPROCESSING`` is 0, which ``env`` then sets; the OpenAI server's engine core
    stays a process apart either way."""
    extra_args: tuple[str, ...] = ()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def events_url(self) -> str:
        """Where a subscriber connects for this server's KV events."""
        return f"tcp://{self.host}:{self.events_port}"

    def argv(self) -> list[str]:
        """The command line of the OpenAI server: ``engine_argv`` and the server's own flags."""
        args = [self.python, "-m", "vllm.entrypoints.openai.api_server", *self.engine_argv()]
        args += ["--host", self.host, "--port", str(self.port), "--enable-prompt-tokens-details"]
        args += ["--disable-uvicorn-access-log"]
        if self.served_name:
            args += ["--served-model-name", self.served_name]
        return [*args, *self.extra_args]

    def engine_argv(self) -> list[str]:
        """The engine's arguments alone (vLLM's ``AsyncEngineArgs`` parses them; ``engines.vllm.in_process``)."""
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{self.events_port}"}
        args = ["--model", self.model, "--dtype", self.dtype]
        args += ["--block-size", str(self.block_tokens), "--enable-prefix-caching"]
        if has_sliding_window(Path(self.model)):
            args += ["--prefix-cache-retention-interval", str(self.block_tokens)]
        args += ["--kv-events-config", json.dumps(events)]
        if self.max_model_len:
            args += ["--max-model-len", str(self.max_model_len)]
        if self.kv_cache_bytes:
            args += ["--kv-cache-memory-bytes", str(self.kv_cache_bytes)]
        if self.max_num_seqs:
            args += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.eager:
            args += ["--enforce-eager", "-O0"]
        if self.uniprocess:
            args += UNIPROCESS_ARGS
        return args

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the explicit --kv-cache-memory-bytes sizes the cache
        env["OMP_NUM_THREADS"] = str(self.threads)
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        if self.uniprocess:
            env.update(UNIPROCESS_ENV)
        env["PYTHONUNBUFFERED"] = "1"
        return env


def has_sliding_window(model_dir: Path) -> bool:
    """Whether the model in ``model_dir`` has sliding-window layers, as kvrelay reads its config
    (``ModelConfig.layer_types``: Gemma 3's, named or from its layer pattern). False for a model kvrelay cannot
    read (its engines need ``ModelConfig`` anyway: ``engines.vllm.identity``) or without a readable
    ``config.json``: vLLM refuses the retention flag for a model without sliding-window layers, so only a model
    known to have them gets it."""
    try:
        config = ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    except (OSError, ValueError):
        return False
    return "sliding_attention" in config.layer_types


def checkpoint_warning(model_dir: Path, figures: EngineFigures) -> str | None:
    """What a worker says at start-up when its engine keeps the prefix cache of a model's sliding-window layers at
    fewer points than the router credits (every block; docs/design.md section 13): a vLLM server started
    without ``--prefix-cache-retention-interval`` = the block size. None when the engine keeps one at every
    block, does not say (an older vLLM), or the model has no sliding-window layers."""
    interval = figures.checkpoint_tokens
    if interval is None or interval == figures.block_size or not has_sliding_window(model_dir):
        return None
    kept = "only at a prompt's end and where two cached prompts part" if interval == 0 else f"every {interval} tokens"
    return (
        f"the engine keeps the prefix cache of {model_dir.name}'s sliding-window layers {kept} "
        f"(--prefix-cache-retention-interval {interval}), so the router will credit prefixes the engine recomputes; "
        f"start it with --prefix-cache-retention-interval {figures.block_size}"
    )


def loopback_specs(
    model_dir: Path,
    count: int,
    dtype: str,
    kv_cache_bytes: int,
    lanes: int | None,
    python: str,
    max_model_len: int | None = None,
    served_name: str | None = None,
) -> tuple[VllmServerSpec, ...]:
    """``count`` servers of ``model_dir`` on free loopback ports, alike but for their ports."""
    return tuple(
        VllmServerSpec(
            model=str(model_dir),
            port=free_port(),
            events_port=free_port(),
            python=python,
            served_name=served_name,
            dtype=dtype,
            max_model_len=max_model_len,
            kv_cache_bytes=kv_cache_bytes,
            max_num_seqs=lanes,
        )
        for _ in range(count)
    )


def worker_engine_flags(spec: VllmServerSpec) -> list[str]:
    """The ``kvrelay worker`` flags that make it serve through this server (``--engine vllm``, its URL and KV
    events, its dtype and lanes)."""
    flags = ["--engine", "vllm", "--engine-url", spec.url, "--kv-events", spec.events_url, "--dtype", spec.dtype]
    return flags + (["--lanes", str(spec.max_num_seqs)] if spec.max_num_seqs else [])


def attached_router_flags(specs: Sequence[VllmServerSpec]) -> list[str]:
    """The ``kvrelay router`` flags that make it drive these servers from its own process (``--vllm-engine``
    each, then the dtype and lanes of the first: one cluster's servers share them)."""
    flags = [arg for spec in specs for arg in ("--vllm-engine", f"{spec.url},{spec.events_url}")]
    if specs:
        flags += ["--vllm-dtype", specs[0].dtype]
        flags += ["--vllm-lanes", str(specs[0].max_num_seqs)] if specs[0].max_num_seqs else []
    return flags


def in_process_router_flags(specs: Sequence[VllmServerSpec]) -> list[str]:
    """The ``kvrelay router`` flags that make it run these servers' engines in its own process instead
    (``--vllm-in-process``, one engine per spec, with the first spec's dtype, lanes, KV cache and context: one
    cluster's engines share them); the router must run from ``specs[0].python``'s venv."""
    if not specs:
        return []
    first = specs[0]
    flags = ["--vllm-in-process", str(len(specs)), "--vllm-dtype", first.dtype]
    flags += ["--vllm-lanes", str(first.max_num_seqs)] if first.max_num_seqs else []
    flags += ["--vllm-kv-cache-bytes", str(first.kv_cache_bytes)] if first.kv_cache_bytes else []
    return flags + (["--vllm-max-model-len", str(first.max_model_len)] if first.max_model_len else [])


@dataclass
class VllmServer:
    """A started (or startable) vLLM server child; see the module contract."""

    spec: VllmServerSpec
    log_path: Path
    env: dict[str, str] | None = None
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)
    started_at: float = field(default=0.0, init=False)

    def start(self) -> VllmServer:
        if self.process is not None and self.process.poll() is None:
            raise VllmStartError(f"vLLM server on port {self.spec.port} is already running")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.spec.argv(),
                env=self.spec.env(self.env),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.started_at = time.monotonic()
        return self

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def wait_ready(self, timeout: float = READY_TIMEOUT_S, stop: threading.Event | None = None) -> float:
        """Block until ``/health`` answers 200; the seconds since ``start``. ``VllmStartError`` otherwise,
        also as soon as ``stop`` is set."""
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if stop is not None and stop.is_set():
                    raise VllmStartError(f"stopped while the vLLM server on port {self.spec.port} was starting")
                if not self.alive:
                    raise VllmStartError(f"vLLM server on port {self.spec.port} exited; log tail:\n{self.tail()}")
                try:
                    if client.get(self.spec.url + "/health").status_code == 200:
                        return time.monotonic() - self.started_at
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
        raise VllmStartError(f"vLLM server on port {self.spec.port} not ready after {timeout} s; log:\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the server's whole process group (the API server, its engine core and workers)."""
        self._signal_group(signal.SIGKILL)
        if self.process is not None:
            self.process.wait()

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM the group; SIGKILL it if the server outlives ``timeout``."""
        if self.process is None:
            return
        self._signal_group(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        self._signal_group(signal.SIGKILL)
        self.process.wait()

    def _signal_group(self, sig: signal.Signals) -> None:
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass
