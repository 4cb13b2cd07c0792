"""Checkpoint capture: full chunks go from device pages to host staging to the tier stack, off the device loop.

Contract (all methods on the event loop's thread):

- ``capture(key, pages)`` is called right after a chunk was registered in the
  pool. Unless a local tier (ram, ssd: in-memory lookups) already holds the
  key, it pins the chunk's pages (one reference, so they cannot be evicted or
  reused while copied), and on a worker thread asks the object tier whether it
  holds the key (a network request: never on the loop, whose heartbeats keep
  the worker alive), else gathers the pages into a host staging tensor, encodes
  the stored form and writes it through the stack (ram, then ssd, then object,
  each optional).
  When the copy is done the pages are unpinned and the chunk is marked durable
  in the pool (evicted first from now on).
- Host staging holds at most ``budget_bytes``. When a capture does not fit it
  waits for earlier captures to finish (``when_full="wait"``) or is skipped
  and counted (``"skip"``). Neither ever blocks the device loop: the device
  thread is not involved at all, and the event loop only does bookkeeping.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

from kvrelay.models.kernels.kv_pages import KVPages
from kvrelay.store.chunk_format import encode_chunk
from kvrelay.store.tier_stack import TierStack
from kvrelay.worker.chunk_io import gather_chunk
from kvrelay.worker.page_pool import PagePool

log = logging.getLogger(__name__)


class Checkpointer:
    def __init__(
        self,
        kv: KVPages,
        pool: PagePool,
        stack: TierStack,
        fingerprint: bytes,
        budget_bytes: int = 64 << 20,
        when_full: Literal["wait", "skip"] = "wait",
        threads: int = 1,
    ) -> None:
        self.kv = kv
        self.pool = pool
        self.stack = stack
        self.fingerprint = fingerprint
        self.budget_bytes = budget_bytes
        self.when_full = when_full
        self.staged_bytes = 0
        self._waiting: deque[tuple[bytes, tuple[int, ...]]] = deque()
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvrelay-checkpoint")
        self._idle = asyncio.Event()
        self._idle.set()
        self.counters = {"captured": 0, "skipped_full": 0, "already_stored": 0, "failed": 0}

    def capture(self, key: bytes, pages: Sequence[int]) -> None:
        if any(tier.contains(key) for tier in self.stack.local_tiers):
            self.counters["already_stored"] += 1
            self.pool.mark_durable(key)
            return
        size = self._size(len(pages))
        if self.staged_bytes + size > self.budget_bytes:
            if self.when_full == "skip" or size > self.budget_bytes:
                self.counters["skipped_full"] += 1
                return
            self._waiting.append((key, tuple(pages)))
            self._idle.clear()
            return
        self._start(key, tuple(pages), size)

    async def drain(self, timeout: float = 30.0) -> None:
        """Wait until no capture is staged or waiting (for tests and shutdown)."""
        await asyncio.wait_for(self._idle.wait(), timeout)

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def _size(self, pages: int) -> int:
        k = self.kv.k
        return 2 * k.shape[0] * pages * k.shape[2] * k.shape[3] * k.shape[4] * k.element_size()

    def _start(self, key: bytes, pages: tuple[int, ...], size: int) -> None:
        self.pool.acquire([pages])
        self.staged_bytes += size
        self._idle.clear()
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._executor, self._save, key, pages)
        future.add_done_callback(lambda f: self._finish(key, pages, size, f))

    def _save(self, key: bytes, pages: tuple[int, ...]) -> tuple[str, ...] | None:
        """The tiers that newly stored the chunk, or None when the object tier already held it."""
        shared = self.stack.object_tier
        if shared is not None and shared.contains(key):
            return None
        staging = gather_chunk(self.kv, pages)
        return self.stack.put(encode_chunk(key, self.fingerprint, staging))

    def _finish(
        self, key: bytes, pages: tuple[int, ...], size: int, future: asyncio.Future[tuple[str, ...] | None]
    ) -> None:
        self.staged_bytes -= size
        self.pool.unref(pages)
        if future.exception() is not None:
            self.counters["failed"] += 1
            log.warning("checkpoint of chunk %s failed: %s", key.hex(), future.exception())
        else:
            self.counters["captured" if future.result() is not None else "already_stored"] += 1
            self.pool.mark_durable(key)
        while self._waiting:
            next_key, next_pages = self._waiting[0]
            next_size = self._size(len(next_pages))
            if self.staged_bytes + next_size > self.budget_bytes:
                break
            self._waiting.popleft()
            resident = self.pool.resident_prefix([next_key])
            if resident:
                self._start(next_key, resident[0], next_size)
        if self.staged_bytes == 0 and not self._waiting:
            self._idle.set()
