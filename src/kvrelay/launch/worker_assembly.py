"""One worker's parts, built from a model source: model, KV pages, runtime, page pool, controller, chunk store.

Shared by ``kvrelay serve`` (one process) and ``kvrelay worker`` (its own
process). ``build_worker`` loads the artifacts off the event loop, has
``Engine.from_artifacts`` build the model, ``kv_tokens // page_tokens`` pages
(at least one), the page pool and the device thread, and returns the wired
parts; the pool's residency callback goes to the controller, whose ``publish``
the caller sets (the in-process router, or the worker endpoint). With a
``StoreSpec`` the worker also gets its chunk tiers (ram, a local chunk
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

from kvrelay.launch import defaults
from kvrelay.models.config import ModelConfig
from kvrelay.models.kernels.kv_pages import KVPages
from kvrelay.models.loading.loader import LoadedArtifacts, load_artifacts
from kvrelay.protocol.chunk_keys import DEFAULT_CHUNK_TOKENS, DEFAULT_PAGE_TOKENS
from kvrelay.protocol.messages import Tier
from kvrelay.store.files import SharedDirTier, SsdTier
from kvrelay.store.peer import PeerServer
from kvrelay.store.ram import RamTier
from kvrelay.store.s3 import S3Tier
from kvrelay.store.tier import ChunkTier, ResidencyEvent
from kvrelay.store.tier_stack import TierStack
from kvrelay.worker.admission import WorkerIdentity
from kvrelay.worker.host import WorkerController
from kvrelay.worker.kv_capture import Checkpointer
from kvrelay.worker.page_pool import PagePool
from kvrelay.worker.restore import StoreRestore
from kvrelay.worker.runtime.engine import Engine, EngineOptions, parse_dtype
from kvrelay.worker.runtime.loop import PagedRuntime
from kvrelay.worker.runtime.torch_threads import confine_threads
from kvrelay.worker.runtime.warmup import measure_speeds


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """How to build one real worker: its id, model, dtype, sizes and chunk tiers (``store`` None: none)."""

    worker_id: str
    model: str | None = None
    """A model directory or GGUF file; None: the default Gemma 3 270M."""
    dtype: str = defaults.DTYPE
    kv_tokens: int = defaults.KV_TOKENS
    page_tokens: int = DEFAULT_PAGE_TOKENS
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    lanes: int = defaults.LANES
    token_budget: int = defaults.TOKEN_BUDGET
    store: StoreSpec | None = None
    share_prefill: bool = True
    """Re-match a prefix before its prefill and wait for a request filling it (``worker.shared_prefill``)."""
    exact_continuations: bool = True
    """A continuation replays its delivered tokens as decode rows, so it is bit-exact (``Job.replay``)."""
    prefill_only_budget: int = defaults.PREFILL_ONLY_BUDGET
    """Tokens of a forward with no decoding lane (``PolicyConfig``; 0: ``token_budget``)."""

    def engine_options(self) -> EngineOptions:
        """The worker's engine: ``kv_tokens`` rounded down to whole pages (at least one), chunks of ``chunk_tokens``."""
        pages = max(1, self.kv_tokens // self.page_tokens)
        return EngineOptions(
            kv_tokens=pages * self.page_tokens,
            page_tokens=self.page_tokens,
            num_lanes=self.lanes,
            token_budget=self.token_budget,
            chunk_tokens=self.chunk_tokens,
            prefill_only_budget=max(self.prefill_only_budget, self.token_budget) if self.prefill_only_budget else 0,
        )


@dataclass(frozen=True, slots=True)
class StoreSpec:
    """The worker's chunk tiers (docs/design.md section 5)."""

    ssd_dir: str
    ram_bytes: int = defaults.RAM_BYTES
    ssd_bytes: int = defaults.SSD_BYTES
    object_dir: str | None = None
    staging_bytes: int = 64 << 20
    s3_endpoint: str | None = None
    s3_bucket: str | None = None
    s3_prefix: str = defaults.S3_PREFIX
    peer_host: str = defaults.PEER_HOST
    """The address the peer server listens on (another host's worker must be able to reach it)."""

    def object_tier(self, on_residency: Callable[[ResidencyEvent], None]) -> ChunkTier | None:
        """The object tier: S3 when an endpoint and bucket are given, else a shared directory, else none."""
        if self.s3_endpoint and self.s3_bucket:
            return S3Tier(
                S3Tier.make_client(self.s3_endpoint), self.s3_bucket, self.s3_prefix, on_residency=on_residency
            )
        if self.object_dir:
            return SharedDirTier(self.object_dir, on_residency=on_residency)
        return None


INITIAL_RESTORE_RATES: dict[Tier, float] = {"ram": 2e9, "ssd": 1e9, "peer": 2e8, "object": 1e8}
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


async def build_worker(settings: WorkerSettings) -> WorkerParts:
    """Load ``settings.model`` and wire one worker's parts on the running loop."""
    dtype = parse_dtype(settings.dtype)
    confine_threads()  # before any torch work: the device thread alone runs torch ops in parallel
    artifacts = await asyncio.to_thread(load_artifacts, settings.model, dtype)
    config = artifacts.config
    engine = Engine.from_artifacts(artifacts, dtype, settings.engine_options())
    runtime, pool, kv = engine.runtime, engine.pool, engine.runtime.kv
    context_limit = min(config.max_position_embeddings, settings.kv_tokens)
    await asyncio.to_thread(measure_speeds, runtime, config.vocab_size, context_limit)
    identity = WorkerIdentity(
        settings.worker_id, new_epoch(), artifacts.name, artifacts.fingerprint, context_limit, settings.chunk_tokens
    )
    controller = WorkerController(
        identity,
        pool,
        runtime,
        config.kv_bytes_per_token(kv.k.element_size()),
        share_prefill=settings.share_prefill,
        exact_continuations=settings.exact_continuations,
    )
    pool.on_residency = controller.publish_residency
    peer = attach_store(settings.store, controller, kv, artifacts.fingerprint) if settings.store is not None else None
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
    controller.restore_bytes_per_s = {
        t: r for t, r in INITIAL_RESTORE_RATES.items() if t != "object" or stack.object_tier is not None
    }
    peer = PeerServer(stack.local_tiers, host=store.peer_host)
    controller.peer_url = peer.url
    return peer
