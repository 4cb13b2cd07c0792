"""The simulated worker's admission: an offer's route re-checked against its real caches.

This is the injected admission of the worker machine (``worker.RequestAdmission``)
for the simulator: a pure page-capacity model over ``sim.cache`` (docs/design.md
section 7, steps 2 to 4). It decides; the caller (``sim.workers``) reserves.

- Every chunk of the offer's route must still be available at its planned tier or
  a faster one; a chunk planned on ``gpu`` that is gone, or a lower-tier chunk
  found nowhere fast enough, declines the offer with ``stale_route``.
- After the route, further chunks of the chain still resident on gpu are used too
  (automatic prefix caching, as vLLM and SGLang do).
- Page demand = pages for prompt plus maximum generation, minus the resident gpu
  prefix pages shared (plus one copy-on-write page when that prefix ends inside a
  page); it must fit in free plus evictable (unpinned, not on the route) pages,
  else ``no_capacity``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvrelay.protocol.chunk_keys import cacheable_chunks
from kvrelay.protocol.messages import DeclineReason, Offer, Tier
from kvrelay.sim.cache import WorkerCaches
from kvrelay.sim.cluster_config import ClusterConfig


@dataclass(frozen=True, slots=True)
class AdmissionPlan:
    """How an accepted offer gets its prefix: gpu keys to share, keys to restore per tier, pages."""

    gpu_keys: tuple[bytes, ...]
    restore: tuple[tuple[bytes, str], ...]
    """(key, tier) in chain order, after the gpu prefix."""
    computed_keys: tuple[bytes, ...]
    """Chain keys computed by prefill, cached on gpu once it finishes."""
    cached_tokens: dict[str, int]
    uncached_tokens: int
    demand_pages: int
    restore_s: float
    restore_bytes: dict[str, int]


@dataclass(frozen=True, slots=True)
class AdmissionDecline:
    reason: DeclineReason
    detail: str


def _tier_rates(rates: Mapping[Tier, float]) -> dict[str, float]:
    return {"gpu": float("inf"), **{str(tier): rate for tier, rate in rates.items()}}


def _source_for(
    key: bytes,
    planned: str,
    source: str,
    caches: WorkerCaches,
    peers: dict[str, WorkerCaches],
    rates: dict[str, float],
) -> str | None:
    """The fastest tier holding ``key`` that is at least as fast as ``planned``, or None."""
    options = [t for t in caches.restore_sources(key) if t != "gpu" and t in rates]
    peer_caches = [peers[source]] if source in peers else [c for c in peers.values() if c is not caches]
    if "peer" in rates and any(key in p.ram or key in p.ssd for p in peer_caches):
        options.append("peer")
    floor = rates.get(planned, float("inf"))
    usable = [t for t in options if rates[t] >= floor]
    return max(usable, key=lambda t: rates[t]) if usable else None


def plan_admission(
    offer: Offer,
    chain: tuple[bytes, ...],
    caches: WorkerCaches,
    peers: dict[str, WorkerCaches],
    cluster: ClusterConfig,
    restore_rates: Mapping[Tier, float] | None = None,
) -> AdmissionPlan | AdmissionDecline:
    """Decide an offer against the worker's caches; touches nothing.

    ``chain`` is the chunk chain of the offer's prompt as the worker derives it;
    the offer's own (routed) chain must be a prefix of it. ``restore_rates`` are the
    worker's (default: the cluster's ``worker``, on the cluster's tiers).
    """
    if chain[: len(offer.chain)] != offer.chain:
        return AdmissionDecline(DeclineReason.STALE_ROUTE, "the offered chain is not the chain of this prompt")
    usable = min(len(chain), cacheable_chunks(len(offer.prompt), cluster.chunk_tokens))
    planned: list[tuple[str, str]] = []
    for seg in offer.route:
        if seg.tier == "recompute":
            break
        planned.extend([(seg.tier, seg.source)] * seg.chunks)
    if len(planned) > usable:
        return AdmissionDecline(
            DeclineReason.STALE_ROUTE, f"route covers {len(planned)} chunks but the chain has {usable}"
        )
    rates = _tier_rates(cluster.rates_of(cluster.worker) if restore_rates is None else restore_rates)
    gpu_keys: list[bytes] = []
    restore: list[tuple[bytes, str]] = []
    for i, (tier, source) in enumerate(planned):
        key = chain[i]
        if key in caches.gpu and not restore:
            gpu_keys.append(key)
            continue
        if tier == "gpu":
            return AdmissionDecline(DeclineReason.STALE_ROUTE, f"gpu prefix chunk {i} is no longer resident")
        found = _source_for(key, tier, source, caches, peers, rates)
        if found is None:
            return AdmissionDecline(DeclineReason.STALE_ROUTE, f"chunk {i} is not available from {tier} or faster")
        restore.append((key, found))
    i = len(planned)
    while i < usable and chain[i] in caches.gpu and not restore:
        gpu_keys.append(chain[i])
        i += 1
    computed = tuple(chain[len(gpu_keys) + len(restore) : usable])
    shared_tokens = len(gpu_keys) * cluster.chunk_tokens
    pages = -(-(len(offer.prompt) + offer.max_new_tokens) // cluster.page_tokens)
    cow = 1 if shared_tokens % cluster.page_tokens else 0
    demand = pages - shared_tokens // cluster.page_tokens + cow
    route_pages = sum(1 for k in set(gpu_keys) if caches.gpu.cache[k] == 0) * caches.gpu.chunk_pages
    room = caches.gpu.free_pages + caches.gpu.evictable_pages - route_pages
    if demand > room:
        return AdmissionDecline(DeclineReason.NO_CAPACITY, f"needs {demand} pages, {room} free or evictable")
    cached: dict[str, int] = {}
    restore_bytes: dict[str, int] = {}
    restore_s = 0.0
    if gpu_keys:
        cached["gpu"] = shared_tokens
    for _, tier in restore:
        cached[tier] = cached.get(tier, 0) + cluster.chunk_tokens
        restore_bytes[tier] = restore_bytes.get(tier, 0) + cluster.chunk_bytes
        restore_s += cluster.chunk_bytes / rates[tier]
    uncached = len(offer.prompt) - (len(gpu_keys) + len(restore)) * cluster.chunk_tokens
    return AdmissionPlan(
        tuple(gpu_keys),
        tuple(restore),
        computed,
        cached,
        uncached,
        demand,
        restore_s,
        restore_bytes,
    )
