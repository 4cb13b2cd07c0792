"""The injected restore handler and the per-assignment bookkeeping of the worker controller.

A ``RestoreHandler`` fills reserved pages with chunks from lower tiers (ram,
ssd, a peer, the object tier) before the route is activated for prefill. It
runs off the device loop (the controller calls it in a worker thread) and
stops at the first chunk it cannot restore: everything after that chunk is
recomputed. The chunk store (``kvrelay.store``) provides the real one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvrelay.protocol.messages import FinishReason, Offer, Tier, WireMessage
from kvrelay.worker.admission import Admission
from kvrelay.worker.runtime.jobs import JobHandle

Reply = Callable[[WireMessage], object]
"""Sends one message to the router that made the offer; what it returns is ignored."""


@dataclass(frozen=True, slots=True)
class RestoreReport:
    """Chunks restored in order from the start of the requested range, and what it cost."""

    tiers: tuple[Tier, ...] = ()
    """The tier each restored chunk came from; its length is the number of chunks restored."""
    bytes_by_tier: dict[Tier, int] = field(default_factory=dict)
    seconds: float = 0.0


class RestoreHandler(Protocol):
    def restore(self, offer: Offer, keys: Sequence[bytes], pages: Sequence[Sequence[int]]) -> RestoreReport:
        """Copy chunk ``keys[i]`` into ``pages[i]`` for i = 0, 1, ... until one is missing or corrupt.

        Called on a worker thread, never on the device loop; returns only when every
        copy it reports has completed.
        """


@dataclass(slots=True)
class Run:
    """One admitted assignment on this worker, from admission to release."""

    offer: Offer
    reply: Reply
    admission: Admission
    page_table: list[int]
    """Prefix pages, then every reserved page, in position order."""
    taken: int
    """How many pages of ``page_table`` the sequence references (prefix + taken from the reservation)."""
    registered: int
    """Full chunks of the sequence already in the pool's index."""
    parent_key: bytes
    """The key of the last registered chunk (the chain's root before any)."""
    cached_tokens: dict[Tier, int] = field(default_factory=dict)
    bytes_by_tier: dict[Tier, int] = field(default_factory=dict)
    handle: JobHandle | None = None
    restoring: bool = False
    fenced: bool = False
    generated: list[int] = field(default_factory=list)
    kv_end: int = 0
    offered_at: float = 0.0
    """When admission began (the worker's clock, as every time here)."""
    accepted_at: float = 0.0
    restore_started_at: float = 0.0
    """When the restore began (0: none ran)."""
    restore_s: float = 0.0
    submitted_at: float = 0.0
    token_times: list[float] = field(default_factory=list)
    rematched: int = 0
    """Chunks shared at the re-match before the prefill (``shared_prefill``), not computed."""
    queued_tokens: int = 0
    """Prompt tokens this run adds to the worker's reported queue."""
    finish_reason: FinishReason | None = None
    """How the runtime ended the job (None: fenced before it answered)."""
