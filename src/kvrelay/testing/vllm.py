"""Real vLLM servers for tests and benchmarks, on a tiny random Llama saved as real files.

``make_vllm_tiny_model(directory)`` writes the tiny Llama of
``kvrelay.testing.tiny_models`` sized so vLLM's CPU attention takes it (head
size 32; a 2,048-token context), without an EOS token. ``tiny_vllm_spec(model_dir, blocks)`` is a
loopback ``VllmServerSpec`` on free ports with ``blocks`` KV blocks of
``VLLM_BLOCK_TOKENS`` tokens, float32, eager. ``started_vllm_servers(specs,
log_dir)`` starts several at once (their start-ups overlap), waits until each
answers ``/health`` (``READY_TIMEOUT_S``, not a sleep), yields them and stops
them all, also when the body raises.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from kvrelay.launch.vllm_server import VLLM_BLOCK_TOKENS, VllmServer, VllmServerSpec, loopback_specs, vllm_python
from kvrelay.testing.tiny_models import make_tiny_model

TINY_CONTEXT = 2048
TINY_LANES = 16
"""Sequences a test's server runs at once (``--max-num-seqs``)."""
TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 4
"""Layers x (K, V) x KV heads x head size x float32 bytes of the tiny Llama."""
READY_TIMEOUT_S = 420.0
"""Start-up of a tiny model takes 60-100 s on a quiet 2-core machine, more while others run."""


def make_vllm_tiny_model(directory: Path, seed: int = 0) -> Path:
    """A tiny random Llama (head size 32, context 2,048, no EOS token, so every greedy stream runs to its
    budget) as real files in ``directory``."""
    return make_tiny_model(
        "llama", directory, seed=seed, head_dim=32, max_position_embeddings=TINY_CONTEXT, eos_token_id=None
    )


def tiny_vllm_spec(model_dir: Path, blocks: int = 64, python: str | None = None) -> VllmServerSpec:
    """A loopback vLLM server of ``model_dir`` on free ports with ``blocks`` KV blocks (float32, eager)."""
    kv_bytes = blocks * VLLM_BLOCK_TOKENS * TINY_KV_BYTES_PER_TOKEN
    return loopback_specs(model_dir, 1, "float32", kv_bytes, TINY_LANES, vllm_python(python), TINY_CONTEXT)[0]


@contextmanager
def started_vllm_servers(
    specs: Sequence[VllmServerSpec], log_dir: Path, env: dict[str, str] | None = None
) -> Iterator[list[VllmServer]]:
    """Start every server at once (in ``env``, default this process's), wait until all are ready, yield them,
    stop them all (see the module docstring)."""
    servers = [VllmServer(spec, log_dir / f"vllm-{spec.port}.log", env=env) for spec in specs]
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready(READY_TIMEOUT_S)
        yield servers
    finally:
        for server in servers:
            server.stop()
