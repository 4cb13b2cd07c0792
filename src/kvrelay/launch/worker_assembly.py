"""One worker's parts, built from a model source: model, KV pages, runtime, page pool, controller, chunk store.

Shared by ``kvrelay serve`` (one process) and ``kvrelay worker`` (its own
process). ``build_worker`` loads the artifacts off the event loop, allocates
``kv_tokens // page_tokens`` pages, starts the device thread and returns the
wired parts; the pool's residency callback goes to the controller, whose
``publish`` the caller sets (the in-process router, or the worker endpoint).
With a ``StoreSpec`` the worker also gets its chunk tiers (ram, a local chunk
directory as ssd, an optional shared-directory object tier), restores from
them and from peers, checkpoints full chunks into them, and serves its ram and
ssd chunks to peers over HTTP; tier residency reaches the controller through
the loop. After ``close`` the device thread and the peer server have stopped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvrelay.models.config import ModelConfig
from kvrelay.models.kernels.kv_pages import KVPages
from kvrelay.models.loading.loader import LoadedArtifacts, load_artifacts
from kvrelay.models.registry import build_model
from kvrelay.store.files import SharedDirTier, SsdTier
from kvrelay.store.peer import PeerServer
from kvrelay.store.ram import RamTier
from kvrelay.store.s3 import S3Tier
from kvrelay.store.tier import ChunkTier, ResidencyEvent
from kvrelay.store.tier_stack import TierStack
from kvrelay.worker.admission import WorkerIdentity
from kvrelay.worker.kv_capture import Checkpointer
from kvrelay.worker.host import WorkerController
from kvrelay.worker.runtime.iteration import PolicyConfig
from kvrelay.worker.page_pool import PagePool
from kvrelay.worker.restore import StoreRestore
from kvrelay.worker.runtime.loop import PagedRuntime
from kvrelay.worker.runtime.torch_threads import confine_threads

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
    store: StoreSpec | None = None


@dataclass(frozen=True, slots=True)
class StoreSpec:
    """The worker's chunk tiers (docs/design.md section 5)."""

    ssd_dir: str
    ram_bytes: int = 1 << 30
    ssd_bytes: int = 16 << 30
    object_dir: str | None = None
    staging_bytes: int = 64 << 20
    s3_endpoint: str | None = None
    s3_bucket: str | None = None
    s3_prefix: str = "kvrelay/"

    def object_tier(self, on_residency: Callable[[ResidencyEvent], None]) -> ChunkTier | None:
        """The object tier: S3 when an endpoint and bucket are given, else a shared directory, else none."""
        if self.s3_endpoint and self.s3_bucket:
            return S3Tier(S3Tier.make_client(self.s3_endpoint), self.s3_bucket, self.s3_prefix,
                          on_residency=on_residency)
        if self.object_dir:
            return SharedDirTier(self.object_dir, on_residency=on_residency)
        return None


INITIAL_RESTORE_RATES = {"ram": 2e9, "ssd": 1e9, "peer": 2e8, "object": 1e8}
"""Bytes per second per tier until the worker has measured its own restores (conservative for a CPU host)."""


@dataclass
class WorkerParts:
    artifacts: LoadedArtifacts
    config: ModelConfig
    runtime: PagedRuntime
    pool: PagePool
    controller: WorkerController
    context_limit: int
    peer: PeerServer | None = None

    def close(self) -> None:
        """Stop the device thread and the peer server (call after the controller's work has quiesced)."""
        if self.controller.checkpointer is not None:
            self.controller.checkpointer.close()
        if self.peer is not None:
            self.peer.close()
        self.runtime.close()


def new_epoch(after: int = -1) -> int:
    """A worker epoch: wall-clock milliseconds, strictly above ``after`` (epochs grow at every start)."""
    return max(after + 1, time.time_ns() // 1_000_000)


async def build_worker(spec: WorkerSpec) -> WorkerParts:
    """Load ``spec.model`` and wire one worker's parts on the running loop."""
    if spec.dtype not in DTYPES:
        raise ValueError(f"dtype {spec.dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
    dtype = DTYPES[spec.dtype]
    confine_threads()  # before any torch work: the device thread alone runs torch ops in parallel
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
    peer = attach_store(spec.store, controller, kv, artifacts.fingerprint) if spec.store is not None else None
    return WorkerParts(artifacts, config, runtime, pool, controller, context_limit, peer)


def attach_store(store: StoreSpec, controller: WorkerController, kv: KVPages, fingerprint: bytes) -> PeerServer:
    """Give ``controller`` its tiers, restore handler and checkpointer; return the started peer server."""
    loop = asyncio.get_running_loop()

    def residency(event: ResidencyEvent) -> None:  # called under a tier's lock, on any thread
        loop.call_soon_threadsafe(controller.publish_residency, event.stored, event.removed, event.tier)

    ssd_dir = Path(store.ssd_dir).expanduser()
    ssd_dir.mkdir(parents=True, exist_ok=True)
    stack = TierStack(
        ram=RamTier(store.ram_bytes, on_residency=residency, verify_payload=False),
        ssd=SsdTier(ssd_dir, store.ssd_bytes, on_residency=residency),
        object_tier=store.object_tier(residency),
    )
    controller.restorer = StoreRestore(kv, stack, fingerprint)
    controller.checkpointer = Checkpointer(kv, controller.pool, stack, fingerprint, store.staging_bytes)
    controller.restore_bytes_per_s = {t: r for t, r in INITIAL_RESTORE_RATES.items()
                                      if t != "object" or stack.object_tier is not None}
    peer = PeerServer(stack.local_tiers)
    controller.peer_url = peer.url
    return peer
