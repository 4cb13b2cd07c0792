"""A vLLM worker's admission: the offer re-checked against its mirror of the engine's blocks (pure).

``admit_offer`` runs, in order, what a native worker's admission runs
(``worker/admission.py``) and declines with the same closed set of reasons:

1. the worker id and epoch (``wrong_epoch``) and the model name
   (``wrong_model``); an offer whose fingerprint differs from the engine's is
   declined only when it claims cached chunks (a chain): a recompute offer
   from a router that plans another fingerprint's chain (a mixed cluster) is
   served, as the engine computes its own KV;
2. the engine unreachable or the worker draining (``shutting_down``), the
   context limit (``over_context_limit``);
3. the worker's own chain of the prompt must extend the offer's chain
   (``wrong_model``); the route's leading gpu chunks must still be resident
   in the mirror (``stale_route``);
4. the block demand: prompt plus budget in blocks, minus the resident prefix
   blocks it shares; the engine's free blocks are its total minus the larger
   of what vLLM reports in use (less what runs that ended since gave back:
   ``VllmWorker.capacity``) and what this worker has promised to requests it
   admitted (vLLM's figures lag); a demand over them is ``no_capacity``.

What is weaker than a native worker (docs/design.md section 13): nothing is
reserved inside vLLM. vLLM allocates blocks as a request grows and, when it
runs out, preempts a running request (recomputing it later) instead of failing
it; the mirror's promises only keep this worker from over-admitting.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass

from kvrelay.protocol.chunk_keys import prompt_chain
from kvrelay.protocol.messages import DeclineReason, Offer


@dataclass(frozen=True, slots=True)
class EngineIdentity:
    """What an offer to a vLLM worker is validated against."""

    worker_id: str
    epoch: int
    model: str
    fingerprint: bytes
    context_limit: int
    block_tokens: int


@dataclass(frozen=True, slots=True)
class EngineCapacity:
    """The engine's device blocks as the worker sees them now."""

    total_blocks: int
    used_blocks: int
    """In use by the engine's requests, as vLLM last reported."""
    promised_blocks: int
    """Promised by this worker to the requests it admitted and has not released."""

    @property
    def free_blocks(self) -> int:
        return max(0, self.total_blocks - max(self.used_blocks, self.promised_blocks))


@dataclass(frozen=True, slots=True)
class EngineAdmission:
    accepted: bool
    reason: DeclineReason | None = None
    detail: str = ""
    chain: tuple[bytes, ...] = ()
    """The worker's own chain of the prompt."""
    prefix_chunks: int = 0
    """Leading chunks of the prompt the engine holds now."""
    demand_blocks: int = 0


def block_demand(prompt_len: int, max_new: int, shared_chunks: int, block_tokens: int) -> int:
    """Blocks a request needs beyond the ``shared_chunks`` resident blocks it starts from."""
    return max(0, -(-(prompt_len + max_new) // block_tokens) - shared_chunks)


def _decline(reason: DeclineReason, detail: str) -> EngineAdmission:
    return EngineAdmission(False, reason, detail)


def admit_offer(
    me: EngineIdentity,
    offer: Offer,
    capacity: EngineCapacity,
    held: Container[bytes],
    engine_up: bool,
    shutting_down: bool = False,
) -> EngineAdmission:
    """Accept ``offer`` or decline it (see the module docstring); ``held``: the chunk keys the engine holds."""
    if offer.epoch != me.epoch or offer.worker_id != me.worker_id:
        return _decline(
            DeclineReason.WRONG_EPOCH,
            f"offer for {offer.worker_id} epoch {offer.epoch}; this is {me.worker_id} epoch {me.epoch}",
        )
    if offer.model != me.model:
        return _decline(DeclineReason.WRONG_MODEL, f"model '{offer.model}' is not served here; served: {me.model}")
    foreign = bool(offer.model_fingerprint) and offer.model_fingerprint != me.fingerprint.hex()
    if foreign and (offer.chain or any(s.chunks for s in offer.route if s.tier != "recompute")):
        return _decline(
            DeclineReason.WRONG_MODEL,
            f"the offer's chunks are of fingerprint {offer.model_fingerprint[:16]}...; this vLLM engine's KV is "
            f"{me.fingerprint.hex()[:16]}...",
        )
    if not engine_up:
        return _decline(DeclineReason.SHUTTING_DOWN, "the vLLM engine is unreachable")
    if shutting_down:
        return _decline(DeclineReason.SHUTTING_DOWN, "the worker is draining")
    total = len(offer.prompt) + offer.max_new_tokens
    if total > me.context_limit:
        return _decline(DeclineReason.OVER_CONTEXT_LIMIT, f"{total} tokens exceed the context limit {me.context_limit}")
    chain = prompt_chain(me.fingerprint, offer.prompt, me.block_tokens)
    if offer.chain and tuple(offer.chain) != chain[: len(offer.chain)]:
        return _decline(DeclineReason.WRONG_MODEL, "the offer's chunk chain does not match this worker's")
    resident = 0
    while resident < len(chain) and chain[resident] in held:
        resident += 1
    promised_gpu = offer.route[0].chunks if offer.route and offer.route[0].tier == "gpu" else 0
    if resident < promised_gpu:
        return _decline(DeclineReason.STALE_ROUTE, f"{promised_gpu} gpu chunks promised, {resident} resident")
    demand = block_demand(len(offer.prompt), offer.max_new_tokens, resident, me.block_tokens)
    if demand > capacity.free_blocks:
        return _decline(
            DeclineReason.NO_CAPACITY,
            f"needs {demand} blocks; the engine has {capacity.total_blocks}, {capacity.used_blocks} in use, "
            f"{capacity.promised_blocks} promised",
        )
    return EngineAdmission(True, None, "", chain, resident, demand)
