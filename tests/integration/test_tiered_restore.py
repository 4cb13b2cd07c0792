"""A prefix computed on worker A, evicted from its pages, restored from A's ssd, from B via peer, and from the
object tier on a fresh worker C; corrupted chunks in each tier are detected and recomputed."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import torch

from kvrelay.protocol.messages import Result, RouteSegment
from kvrelay.store.files import SharedDirTier, SsdTier
from kvrelay.store.peer import PeerServer
from kvrelay.store.tier_stack import TierStack
from kvrelay.testing.tiny_models import make_tiny_model
from kvrelay.worker.chunk_io import gather_chunk
from kvrelay.worker.kv_capture import Checkpointer
from kvrelay.worker.restore import StoreRestore
from tests.support.worker_harness import WorkerHarness

PROMPT = tuple(range(7, 7 + 150))  # 2 full chunks + 22 tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("qwen3", tmp_path_factory.mktemp("tiny-qwen3"))


def with_store(h: WorkerHarness, stack: TierStack) -> None:
    h.controller.restorer = StoreRestore(h.kv, stack, h.fingerprint)
    h.controller.checkpointer = Checkpointer(h.kv, h.pool, stack, h.fingerprint)


def evict_everything(h: WorkerHarness) -> None:
    r = h.pool.reserve("evict", h.pool.num_free + h.pool.num_cached)
    assert r is not None
    h.pool.release(r)
    assert h.pool.num_cached == 0


def run(model_dir: Path, body: Callable[..., Awaitable[None]], workers: int = 1) -> None:
    async def main() -> None:
        harnesses = [WorkerHarness(model_dir) for _ in range(workers)]
        try:
            await body(*harnesses)
        finally:
            for h in harnesses:
                h.close()

    asyncio.run(main())


async def compute_on_a(a: WorkerHarness, stack: TierStack) -> tuple[list[int], dict[bytes, torch.Tensor]]:
    """Cold run on A with checkpointing; returns its tokens and the KV of its two chunks."""
    with_store(a, stack)
    _, replies = a.offer("cold", PROMPT, 8)
    cold = await replies.wait_for(Result)
    await a.quiesce()
    await a.controller.checkpointer.drain()
    kv = {
        key: gather_chunk(a.kv, pages)
        for key in (m.stored[0] for m in a.published if m.stored)
        for pages in a.pool.resident_prefix([key])
    }
    assert len(kv) == 2 and a.controller.checkpointer.counters["captured"] == 2
    return list(cold.tokens), kv


async def restored(h: WorkerHarness, route: RouteSegment, rid: str) -> tuple[Result, dict[bytes, torch.Tensor]]:
    _, replies = h.offer(rid, PROMPT, 8, route=(route,))
    result = await replies.wait_for(Result)
    await h.quiesce()
    chunks = {}
    for message in h.published:
        for key in message.stored:
            for pages in h.pool.resident_prefix([key]):
                chunks[key] = gather_chunk(h.kv, pages)
    h.pool.check()
    return result, chunks


def test_restore_from_ssd_peer_and_object_equals_the_cold_computation(model_dir: Path, tmp_path: Path) -> None:
    shared = tmp_path / "object"

    async def body(a: WorkerHarness, b: WorkerHarness, c: WorkerHarness) -> None:
        stack_a = TierStack(ssd=SsdTier(tmp_path / "a-ssd", 1 << 30), object_tier=SharedDirTier(shared))
        cold_tokens, cold_kv = await compute_on_a(a, stack_a)
        assert all(stack_a.ssd.contains(k) for k in cold_kv) and all(stack_a.object_tier.contains(k) for k in cold_kv)
        assert a.pool.is_durable(next(iter(cold_kv)))

        evict_everything(a)
        result, kv = await restored(a, RouteSegment("ssd", 2), "from-ssd")
        assert list(result.tokens) == cold_tokens and result.usage.cached_tokens == {"ssd": 128}
        assert a.controller.heartbeat().restore_bytes_per_s["ssd"] > 0, "heartbeats carry the measured rate"
        assert all(torch.equal(kv[k], cold_kv[k]) for k in cold_kv)

        peer = PeerServer(stack_a.local_tiers)
        try:
            with_store(b, TierStack(ssd=SsdTier(tmp_path / "b-ssd", 1 << 30)))
            result, kv = await restored(b, RouteSegment("peer", 2, peer.url), "from-peer")
            assert list(result.tokens) == cold_tokens and result.usage.cached_tokens == {"peer": 128}
            assert all(torch.equal(kv[k], cold_kv[k]) for k in cold_kv)
        finally:
            peer.close()

        with_store(c, TierStack(object_tier=SharedDirTier(shared)))
        result, kv = await restored(c, RouteSegment("object", 2), "from-object")
        assert list(result.tokens) == cold_tokens and result.usage.cached_tokens == {"object": 128}
        assert all(torch.equal(kv[k], cold_kv[k]) for k in cold_kv)

    run(model_dir, body, workers=3)


def flip_payload_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("tier", ["ssd", "peer", "object"])
def test_a_corrupted_chunk_is_detected_counted_and_recomputed(model_dir: Path, tmp_path: Path, tier: str) -> None:
    async def body(a: WorkerHarness, b: WorkerHarness) -> None:
        # The corrupted tier is the only one holding the chunks, so nothing else can stand in for it.
        ssd_a, shared = SsdTier(tmp_path / "a-ssd", 1 << 30), SharedDirTier(tmp_path / "object")
        stack = TierStack(object_tier=shared) if tier == "object" else TierStack(ssd=ssd_a)
        cold_tokens, cold_kv = await compute_on_a(a, stack)
        first = next(iter(cold_kv))
        corrupted_tier = ssd_a if tier in ("ssd", "peer") else shared
        files = [p for p in Path(corrupted_tier.directory).rglob("*") if p.is_file() and first.hex() in p.name]
        assert files, "the chunk file of the first key exists"
        flip_payload_byte(files[0])
        peer = PeerServer((ssd_a,)) if tier == "peer" else None
        try:
            if tier == "ssd":
                evict_everything(a)
                worker, route = a, RouteSegment("ssd", 2)
            elif tier == "peer":
                with_store(b, TierStack(ssd=SsdTier(tmp_path / "b-ssd", 1 << 30)))
                worker, route = b, RouteSegment("peer", 2, peer.url)
            else:
                corrupted_tier = SharedDirTier(tmp_path / "object")  # B's own view of the shared directory
                with_store(b, TierStack(object_tier=corrupted_tier))
                worker, route = b, RouteSegment("object", 2)
            result, _ = await restored(worker, route, "after-corruption")
        finally:
            if peer is not None:
                peer.close()
        assert list(result.tokens) == cold_tokens
        assert result.usage.recomputed_tokens == len(PROMPT), "the corrupt first chunk stops the restore"
        assert corrupted_tier.counters().corrupt == 1
        # The corrupt copy is gone: the tier holds the key no more, or holds the fresh copy that the
        # recompute's checkpoint wrote once the prompt's chunks were registered at the first token.
        assert not corrupted_tier.contains(first) or corrupted_tier.get(first) is not None
        assert corrupted_tier.counters().corrupt == 1

    run(model_dir, body, workers=2)


@pytest.mark.parametrize(("when_full", "captured", "skipped"), [("wait", 2, 0), ("skip", 1, 1)])
def test_host_staging_budget_waits_or_skips(
    model_dir: Path, tmp_path: Path, when_full: str, captured: int, skipped: int
) -> None:
    async def body(a: WorkerHarness) -> None:
        stack = TierStack(ssd=SsdTier(tmp_path / "ssd", 1 << 30))
        checkpointer = Checkpointer(a.kv, a.pool, stack, a.fingerprint, when_full=when_full)  # type: ignore[arg-type]
        checkpointer.budget_bytes = checkpointer._size(a.pool.pages_per_chunk)  # room for exactly one chunk
        a.controller.checkpointer = checkpointer
        _, replies = a.offer("r", PROMPT, 4)  # both prompt chunks are registered at the first token
        await replies.wait_for(Result)
        await a.quiesce()
        await checkpointer.drain()
        assert checkpointer.counters["captured"] == captured and checkpointer.counters["skipped_full"] == skipped
        assert checkpointer.staged_bytes == 0
        assert len(stack.ssd.keys()) == captured
        a.pool.check()
        assert a.pool.num_referenced == 0, "pages pinned for a capture are unpinned when it ends"

    run(model_dir, body)


def test_checkpoints_never_wait_on_the_object_tier_on_the_event_loop(model_dir: Path, tmp_path: Path) -> None:
    """An object tier that does not answer (a listener that never replies) stalls only the checkpoint thread: the
    event loop, whose heartbeats keep the worker alive at its router, keeps turning."""
    import socket
    import time

    from kvrelay.store.ram import RamTier
    from kvrelay.store.s3 import S3Tier

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"

    async def body(a: WorkerHarness) -> None:
        client = S3Tier.make_client(endpoint, connect_timeout_s=1.0, read_timeout_s=1.0)
        stack = TierStack(ram=RamTier(1 << 30), object_tier=S3Tier(client, "silent-bucket"))
        with_store(a, stack)
        longest = 0.0
        done = asyncio.Event()

        async def watch() -> None:
            nonlocal longest
            while not done.is_set():
                before = time.monotonic()
                await asyncio.sleep(0.01)
                longest = max(longest, time.monotonic() - before)

        watcher = asyncio.get_running_loop().create_task(watch())
        _, replies = a.offer("r", PROMPT, 4)
        await replies.wait_for(Result)
        await a.quiesce()
        assert a.controller.checkpointer is not None
        await a.controller.checkpointer.drain(60)
        done.set()
        await watcher
        assert a.controller.checkpointer.counters["failed"] == 2  # both chunks: the object tier never answered
        assert longest < 0.5, f"the event loop stalled for {longest:.2f} s"

    try:
        run(model_dir, body)
    finally:
        silent.close()
