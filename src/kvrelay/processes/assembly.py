"""One worker's parts, built from a model source: model, KV pages, runtime, page pool, controller.

Shared by ``kvrelay serve`` (one process) and ``kvrelay worker`` (its own
process). ``build_worker`` loads the artifacts off the event loop, allocates
``kv_tokens // page_tokens`` pages, starts the device thread and returns the
wired parts; the pool's residency callback goes to the controller, whose
``publish`` the caller sets (the in-process router, or the worker endpoint).
After ``close`` the device thread has stopped.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import torch

from kvrelay.models.config import ModelConfig
from kvrelay.models.kv_pages import KVPages
from kvrelay.models.loader import LoadedArtifacts, load_artifacts
from kvrelay.models.registry import build_model
from kvrelay.worker.admission import WorkerIdentity
from kvrelay.worker.controller import WorkerController
from kvrelay.worker.iteration import PolicyConfig
from kvrelay.worker.page_pool import PagePool
from kvrelay.worker.runtime import PagedRuntime

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    worker_id: str
    model: str | None = None
    """A model directory or GGUF file; None: the default Gemma 3 270M."""
    dtype: str = "bfloat16"
    kv_tokens: int = 65536
    page_tokens: int = 16
    chunk_tokens: int = 64
    lanes: int = 16
    token_budget: int = 512


@dataclass
class WorkerParts:
    artifacts: LoadedArtifacts
    config: ModelConfig
    runtime: PagedRuntime
    pool: PagePool
    controller: WorkerController
    context_limit: int

    def close(self) -> None:
        """Stop the device thread (call after the controller's work has quiesced)."""
        self.runtime.close()


def new_epoch(after: int = -1) -> int:
    """A worker epoch: wall-clock milliseconds, strictly above ``after`` (epochs grow at every start)."""
    return max(after + 1, time.time_ns() // 1_000_000)


async def build_worker(spec: WorkerSpec) -> WorkerParts:
    """Load ``spec.model`` and wire one worker's parts on the running loop."""
    if spec.dtype not in DTYPES:
        raise ValueError(f"dtype {spec.dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
    dtype = DTYPES[spec.dtype]
    artifacts = await asyncio.to_thread(load_artifacts, spec.model, dtype)
    config = artifacts.config
    model = build_model(config, artifacts.weights, dtype)
    pages = max(1, spec.kv_tokens // spec.page_tokens)
    kv = KVPages.allocate(config, pages, spec.page_tokens, dtype)
    runtime = PagedRuntime(model, kv, PolicyConfig(num_lanes=spec.lanes, token_budget=spec.token_budget))
    context_limit = min(config.max_position_embeddings, spec.kv_tokens)
    identity = WorkerIdentity(spec.worker_id, new_epoch(), artifacts.name, artifacts.fingerprint, context_limit,
                              spec.chunk_tokens)
    pool = PagePool(pages, spec.page_tokens, spec.chunk_tokens)
    controller = WorkerController(identity, pool, runtime, config.kv_bytes_per_token(kv.k.element_size()))
    pool.on_residency = controller.publish_residency
    return WorkerParts(artifacts, config, runtime, pool, controller, context_limit)
