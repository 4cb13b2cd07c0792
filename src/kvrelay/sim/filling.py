"""Prefix sharing on a simulated worker: which started request is restoring or computing each chunk onto its
device, and the re-match of a prefill's prefix when it starts.

A prefill whose next chunk another started request is filling waits for it instead of computing it twice
(``sim.workers`` module docstring); a prefill not yet started counts such chunks as shared.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvrelay.sim.cache import GpuPool, WorkerCaches
from kvrelay.sim.work import Work


class Filling:
    """Chunk key -> the started request filling it; the first claim of a key holds it until released."""

    def __init__(self) -> None:
        self._by_key: dict[bytes, Work] = {}

    def claim(self, work: Work, keys: Iterable[bytes]) -> None:
        for key in keys:
            self._by_key.setdefault(key, work)

    def unclaim(self, work: Work, keys: Iterable[bytes]) -> None:
        for key in keys:
            if self._by_key.get(key) is work:
                del self._by_key[key]

    def by_other(self, work: Work, key: bytes) -> bool:
        """Whether a request other than ``work`` is filling ``key``."""
        filler = self._by_key.get(key)
        return filler is not None and filler is not work

    def waits(self, work: Work) -> bool:
        """Whether another started request is filling the next chunk ``work`` would compute."""
        return bool(work.computed) and self.by_other(work, work.computed[0])

    def shared_chunks(self, work: Work, on_device: GpuPool) -> int:
        """The leading chunks ``work`` would compute that are on the device or that another request is filling."""
        shared = 0
        for key in work.computed:
            if not (key in on_device or self.by_other(work, key)):
                break
            shared += 1
        return shared


def rematch(work: Work, caches: WorkerCaches, chunk_tokens: int) -> int:
    """Share the leading chunks ``work`` still has to compute that are now on the device (another request filled
    them): pin them, return their reserved pages and take them off its prefill. Returns how many it shared."""
    gpu, n = caches.gpu, 0
    while n < len(work.computed) and work.computed[n] in gpu:
        n += 1
    if not n:
        return 0
    for key in work.computed[:n]:
        gpu.pin(key)
        work.pinned.append(key)
    del work.computed[:n]
    pages = n * gpu.chunk_pages
    caches.release(pages)
    work.reserved_pages -= pages
    work.prefill_left -= n * chunk_tokens
    work.rematched += n
    return n
