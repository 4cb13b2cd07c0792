"""A restore handler test double: writes known KV (captured from a real cold run) into pages.

It stands in for the chunk store's tiers (issue 6 gives the real one). ``gate``
lets a test hold a restore in flight; ``log`` records the order of events.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch

from kvrelay.models.kernels.kv_pages import KVPages
from kvrelay.protocol.messages import Offer
from kvrelay.worker.handlers import RestoreReport


def capture(kv: KVPages, pages: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one chunk's pages, copied out of the pool."""
    index = torch.tensor(list(pages))
    return kv.k[:, index].clone(), kv.v[:, index].clone()


class KnownKVRestore:
    def __init__(self, kv: KVPages, chunks: dict[bytes, tuple[torch.Tensor, torch.Tensor]], tier: str = "ram") -> None:
        self.kv = kv
        self.chunks = chunks
        self.tier = tier
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Event()
        self.log: list[str] = []

    def restore(self, offer: Offer, keys: Sequence[bytes], pages: Sequence[Sequence[int]]) -> RestoreReport:
        started = time.perf_counter()
        self.log.append("restore_started")
        self.started.set()
        if not self.gate.wait(30):
            raise TimeoutError("the test never opened the restore gate")
        tiers = []
        nbytes = 0
        for key, target in zip(keys, pages):
            chunk = self.chunks.get(key)
            if chunk is None:
                break
            index = torch.tensor(list(target))
            self.kv.k[:, index] = chunk[0]
            self.kv.v[:, index] = chunk[1]
            tiers.append(self.tier)
            nbytes += chunk[0].numel() * chunk[0].element_size() * 2
        self.log.append("restore_done")
        return RestoreReport(tuple(tiers), {self.tier: nbytes}, time.perf_counter() - started)
