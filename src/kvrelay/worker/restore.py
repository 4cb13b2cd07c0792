"""The chunk store's restore handler: fills reserved pages from ram, ssd, a peer or the object tier.

``StoreRestore.restore`` runs on a worker thread (never the device loop). For
each requested chunk, in order, it looks in the local tiers, then the peers the
route names, then the object tier (``TierStack.fetch``: remote finds are
localized into the ssd tier and read back through ``mmap``), verifies it (a
corrupt copy is a miss, reported and removed by its tier) and copies it into
its pages. It stops at the first miss: the rest is recomputed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvrelay.models.kernels.kv_pages import KVPages
from kvrelay.protocol.messages import Offer
from kvrelay.store.peer import PeerTier
from kvrelay.store.tier_stack import TierStack
from kvrelay.worker.chunk_io import scatter_chunk
from kvrelay.worker.handlers import RestoreReport


class StoreRestore:
    def __init__(self, kv: KVPages, stack: TierStack, fingerprint: bytes, peer_timeout_s: float = 5.0) -> None:
        self.kv = kv
        self.stack = stack
        self.fingerprint = fingerprint
        self.peer_timeout_s = peer_timeout_s
        self._peers: dict[str, PeerTier] = {}

    def _peer(self, url: str) -> PeerTier | None:
        if not url.startswith("http://"):
            return None
        if url not in self._peers:
            self._peers[url] = PeerTier(url, self.peer_timeout_s)
        return self._peers[url]

    def restore(self, offer: Offer, keys: Sequence[bytes], pages: Sequence[Sequence[int]]) -> RestoreReport:
        started = time.perf_counter()
        remotes = [p for s in offer.route if s.tier == "peer" and (p := self._peer(s.source)) is not None]
        tiers: list[str] = []
        nbytes: dict[str, int] = {}
        for key, target in zip(keys, pages):
            hit = self.stack.fetch(key, self.fingerprint, remotes)
            if hit is None:
                break
            try:
                scatter_chunk(self.kv, target, hit.view.tensor())
            except ValueError:
                break
            tier = "peer" if hit.tier == "peer" else hit.tier
            tiers.append(tier)
            nbytes[tier] = nbytes.get(tier, 0) + hit.view.nbytes
        return RestoreReport(tuple(tiers), nbytes, time.perf_counter() - started)  # type: ignore[arg-type]
