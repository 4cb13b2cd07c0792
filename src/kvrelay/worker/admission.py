"""Local admission: the worker's re-check of an offer against its real page pool (docs/design.md section 7).

``admit`` runs the steps in order and either returns an accepted admission
holding a reservation and the referenced resident prefix, or a decline with a
reason from the protocol's closed set, having changed nothing:

1. validate the worker epoch and the model (name and fingerprint; the worker
   recomputes the chunk chain itself and requires the offer's to match); an
   offer of another fingerprint is declined only when it claims cached chunks:
   a recompute offer planned over another engine's chain (a mixed cluster of
   native and vLLM workers) is served, as the worker computes its own KV;
2. refuse when shutting down or over the context limit;
3. find the resident prefix; the route's leading gpu segment must still be
   resident (else ``stale_route``, and the router re-scores without it);
4. compute the incremental page demand: prompt plus maximum generation, minus
   the shared resident prefix pages, plus one copy-on-write page when the
   shared prefix ends inside a page;
5. protect the prefix pages, plan evictions among unreferenced pages (durable
   first, then least recently used) and reserve atomically, or decline
   ``no_capacity``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from kvrelay.core.planning.predicted_ttft import page_demand
from kvrelay.protocol.chunk_keys import DEFAULT_CHUNK_TOKENS, prompt_chain
from kvrelay.protocol.messages import DeclineReason, Offer
from kvrelay.worker.page_pool import Eviction, PagePool, Reservation


@dataclass(frozen=True, slots=True)
class WorkerIdentity:
    """What an offer is validated against."""

    worker_id: str
    epoch: int
    model: str
    fingerprint: bytes
    context_limit: int
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS


class Admission(NamedTuple):
    accepted: bool
    reason: DeclineReason | None = None
    detail: str = ""
    reservation: Reservation | None = None
    prefix: tuple[tuple[int, ...], ...] = ()
    """Pages of the resident prefix chunks, now referenced by the sequence."""
    chain: tuple[bytes, ...] = ()
    """The worker's own chunk chain of the prompt."""
    demand: int = 0
    evictions: tuple[Eviction, ...] = ()


def decline(reason: DeclineReason, detail: str) -> Admission:
    return Admission(False, reason, detail)


def admit(pool: PagePool, me: WorkerIdentity, offer: Offer, shutting_down: bool = False) -> Admission:
    """Admit ``offer`` into ``pool`` or decline it (see the module docstring)."""
    if offer.epoch != me.epoch or offer.worker_id != me.worker_id:
        return decline(
            DeclineReason.WRONG_EPOCH,
            f"offer for {offer.worker_id} epoch {offer.epoch}; this is {me.worker_id} epoch {me.epoch}",
        )
    if offer.model != me.model:
        return decline(DeclineReason.WRONG_MODEL, f"model '{offer.model}' is not served here; served: {me.model}")
    foreign = bool(offer.model_fingerprint) and offer.model_fingerprint != me.fingerprint.hex()
    if foreign and (offer.chain or any(s.chunks for s in offer.route if s.tier != "recompute")):
        return decline(
            DeclineReason.WRONG_MODEL,
            f"fingerprint {offer.model_fingerprint[:16]}... differs from {me.fingerprint.hex()[:16]}...",
        )
    if shutting_down:
        return decline(DeclineReason.SHUTTING_DOWN, "the worker is draining")
    total = len(offer.prompt) + offer.max_new_tokens
    if total > me.context_limit:
        return decline(DeclineReason.OVER_CONTEXT_LIMIT, f"{total} tokens exceed the context limit {me.context_limit}")
    chain = prompt_chain(me.fingerprint, offer.prompt, me.chunk_tokens)
    if offer.chain and tuple(offer.chain) != chain[: len(offer.chain)]:
        return decline(DeclineReason.WRONG_MODEL, "the offer's chunk chain does not match this worker's")
    promised_gpu = offer.route[0].chunks if offer.route and offer.route[0].tier == "gpu" else 0
    prefix = pool.resident_prefix(chain)
    if len(prefix) < promised_gpu:
        return decline(DeclineReason.STALE_ROUTE, f"{promised_gpu} gpu chunks promised, {len(prefix)} resident")
    shared_tokens = len(prefix) * me.chunk_tokens
    demand = page_demand(len(offer.prompt), offer.max_new_tokens, shared_tokens, pool.page_tokens)
    protected = [p for pages in prefix for p in pages]
    before = len(pool.evictions)
    reservation = pool.reserve(f"{offer.assignment.request_id}#{offer.assignment.attempt}", demand, protected)
    if reservation is None:
        return decline(
            DeclineReason.NO_CAPACITY, f"needs {demand} pages; free {pool.num_free}, evictable {pool.num_evictable}"
        )
    pool.acquire(prefix)
    return Admission(True, None, "", reservation, tuple(prefix), chain, demand, tuple(pool.evictions[before:]))
