"""vLLM servers shared by every setup of a replay, emptied between replays, and the faces in front of them.

Contract:
- ``shared_engines(model_dir, count, blocks, log_dir, real)`` starts ``count`` vLLM OpenAI servers of
  ``model_dir`` (``launch.vllm_server.loopback_specs`` at ``kvrelay.testing.vllm``'s tiny sizes: float32,
  eager, ``blocks`` KV blocks of 64 tokens, prefix caching, KV events on ZMQ; with ``real``, a ``RealModel``'s
  dtype, context and KV bytes per token instead, ``real_model``), served under the directory's name (the name
  kvrelay's router gives that model, so every setup takes the same requests), with vLLM's development endpoints
  on (``VLLM_SERVER_DEV_MODE``, for ``/reset_prefix_cache``); yields them once all are ready and stops them all
  after, also on error.
- ``empty_caches(engines)`` makes every engine forget its prefix cache (``POST /reset_prefix_cache``, retried
  while blocks are still held, ``RuntimeError`` naming the engine after ``limit_s``), so each replay starts
  cold as the native setups do, without the minutes of a vLLM start; then sends each a one-token completion,
  so the engine steps and publishes the cache's ``AllBlocksCleared`` KV event before the next setup's
  workers subscribe (a kvrelay worker that saw it later would start a new epoch under its first request).
- ``kvrelay_over_vllm(name, policy, engines, model_dir, home, attached)``: a ``Face`` of ``kvrelay router
  --policy policy`` driving every engine from its own process (``--vllm-engine``), or (``attached`` False) with
  one ``kvrelay worker --engine vllm`` process per engine (either way the workers learn residency from the
  engine's KV events); ``peer_face(name, engines, home)``: an empty ``Face`` to start a peer router on, with the
  engines' URLs. Both count the engines' processes as the face's workers (``Face.engine_pids``).
- ``kvrelay_in_process(name, policy, engines, model_dir, home)``: a ``Face`` of ``kvrelay router --policy policy``
  run by vLLM's interpreter with engines of its own in its process (``--vllm-in-process``), one per shared
  server, with the servers' engine arguments (dtype, lanes, KV cache, context); the shared servers idle meanwhile.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvrelay.bench.trace.faces import Face, kvrelay_argv, process_env, spawn
from kvrelay.engines.vllm.identity import kv_bytes_per_token
from kvrelay.launch.vllm_server import (
    VllmServer,
    attached_router_flags,
    in_process_router_flags,
    loopback_specs,
    vllm_python,
    worker_engine_flags,
)
from kvrelay.testing.ports import free_port
from kvrelay.testing.vllm import (
    TINY_CONTEXT,
    TINY_KV_BYTES_PER_TOKEN,
    TINY_LANES,
    VLLM_BLOCK_TOKENS,
    started_vllm_servers,
)
from kvrelay.transport.auth import SECRET_ENV_VAR


@dataclass(frozen=True, slots=True)
class RealModel:
    """A model other than the tests' tiny one: the dtype its engines run and the context they serve."""

    dtype: str
    context: int


def real_model(model_dir: Path, dtype: str, context: int) -> RealModel:
    """``model_dir``'s engines at ``dtype`` with a context of ``context`` tokens, at most the model's own."""
    config = json.loads((model_dir / "config.json").read_text())
    own = config.get("max_position_embeddings") or config.get("text_config", {}).get("max_position_embeddings")
    return RealModel(dtype, min(context, int(own)) if own else context)


@contextmanager
def shared_engines(
    model_dir: Path, count: int, blocks: int, log_dir: Path, real: RealModel | None = None
) -> Iterator[list[VllmServer]]:
    """Start ``count`` vLLM servers at once, yield them when all are ready, stop them all (module contract)."""
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    if real is None:
        dtype, context, per_token = "float32", TINY_CONTEXT, TINY_KV_BYTES_PER_TOKEN
    else:
        dtype, context, per_token = real.dtype, real.context, kv_bytes_per_token(model_dir, real.dtype)
    kv_bytes = blocks * VLLM_BLOCK_TOKENS * per_token
    specs = loopback_specs(model_dir, count, dtype, kv_bytes, TINY_LANES, vllm_python(), context, model_dir.name)
    with started_vllm_servers(specs, log_dir, env) as servers:
        yield servers


def empty_caches(engines: Sequence[VllmServer], limit_s: float = 60.0) -> None:
    """Reset every engine's prefix cache (see the module contract)."""
    with httpx.Client(timeout=30) as client:
        for engine in engines:
            deadline = time.monotonic() + limit_s
            while True:
                answer = client.post(engine.spec.url + "/reset_prefix_cache")
                if answer.status_code == 200 and answer.json().get("success"):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the vLLM server at {engine.spec.url} did not reset its prefix cache within {limit_s:.0f} s "
                        f"(last answer {answer.status_code} {answer.text[:200]}); see {engine.log_path}"
                    )
                time.sleep(0.5)
            body = {"model": engine.spec.served_name, "prompt": " flush", "max_tokens": 1, "temperature": 0.0}
            answer = client.post(engine.spec.url + "/v1/completions", json=body)
            if answer.status_code != 200:
                raise RuntimeError(
                    f"the vLLM server at {engine.spec.url} did not answer a completion after its reset "
                    f"({answer.status_code} {answer.text[:200]}); see {engine.log_path}"
                )


def _engine_pids(engines: Sequence[VllmServer]) -> tuple[int, ...]:
    return tuple(e.process.pid for e in engines if e.process is not None)


def kvrelay_over_vllm(
    name: str, policy: str, engines: Sequence[VllmServer], model_dir: Path, home: Path, attached: bool = False
) -> Face:
    """kvrelay's router with ``policy`` driving the engines from its own process (``attached``: ``kvrelay router
    --vllm-engine``), else through one ``kvrelay worker --engine vllm`` process per engine; ready once a
    completion answers."""
    home.mkdir(parents=True, exist_ok=True)
    port, worker_port = free_port(), free_port()
    face = Face(name, f"http://127.0.0.1:{port}", home, engine_pids=_engine_pids(engines))
    secret = {SECRET_ENV_VAR: secrets.token_hex(16)}
    router = ["--host", "127.0.0.1", "--port", str(port), "--worker-port", str(worker_port)]
    router += ["--model", str(model_dir), "--policy", policy]
    if attached:
        router += attached_router_flags([e.spec for e in engines])
    spawn(face, "router", kvrelay_argv("router", *router), process_env(home, 1, **secret))
    if attached:
        return face
    for i, engine in enumerate(engines, start=1):
        worker = ["--worker-id", f"w{i}", "--router", f"ws://127.0.0.1:{worker_port}/workers"]
        worker += ["--model", str(model_dir), *worker_engine_flags(engine.spec)]
        spawn(face, f"w{i}", kvrelay_argv("worker", *worker), process_env(home / f"w{i}", 1, **secret))
    return face


def kvrelay_in_process(name: str, policy: str, engines: Sequence[VllmServer], model_dir: Path, home: Path) -> Face:
    """kvrelay's router with ``policy`` and one in-process engine per shared server (module contract); ready once
    a completion answers."""
    home.mkdir(parents=True, exist_ok=True)
    port, worker_port = free_port(), free_port()
    face = Face(name, f"http://127.0.0.1:{port}", home)
    router = ["--host", "127.0.0.1", "--port", str(port), "--worker-port", str(worker_port)]
    router += ["--model", str(model_dir), "--policy", policy, *in_process_router_flags([e.spec for e in engines])]
    argv = kvrelay_argv("router", *router, python=vllm_python())
    spawn(face, "router", argv, process_env(home, 1, **{SECRET_ENV_VAR: secrets.token_hex(16)}))
    return face


def peer_face(name: str, engines: Sequence[VllmServer], home: Path) -> tuple[Face, list[str]]:
    """A face with no processes yet (the caller starts a peer router on its URL) and the engines' URLs."""
    home.mkdir(parents=True, exist_ok=True)
    face = Face(name, f"http://127.0.0.1:{free_port()}", home, engine_pids=_engine_pids(engines))
    return face, [e.spec.url for e in engines]
