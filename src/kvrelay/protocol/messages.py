"""Wire messages between router and workers (docs/design.md sections 3 and 5).

Every message is an immutable ``msgspec.Struct`` tagged by a ``type`` field and
carrying the protocol version ``v``. Only these types cross the wire; timers,
reservation handles, tensors and KV bytes are local-only (see ``codec``).

Identifiers:
- ``Assignment(request_id, attempt)`` names one attempt of one request. Every
  offer, acknowledgement, delta, result and cancellation carries one.
- ``worker_id`` is stable; ``epoch`` grows at every worker start and whenever
  the worker learns that its epoch was fenced; heartbeat and residency ``seq``
  grow within an epoch.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

import msgspec

from kvrelay.protocol.chunk_keys import DEFAULT_CHUNK_TOKENS, DEFAULT_PAGE_TOKENS
from kvrelay.protocol.trace_context import TraceParent

PROTOCOL_VERSION = 1
"""The only version this build speaks; a frame with another ``v`` is rejected."""

MAX_KEY_BYTES = 32
"""Chunk keys are 16-byte blake2b digests; anything longer is not a key."""

ChunkKey = Annotated[bytes, msgspec.Meta(max_length=MAX_KEY_BYTES)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0.0)]
ShortStr = Annotated[str, msgspec.Meta(max_length=256)]

Tier = Literal["gpu", "ram", "ssd", "peer", "object", "recompute"]
TIERS: tuple[str, ...] = ("gpu", "ram", "ssd", "peer", "object", "recompute")
"""Tiers fastest first (docs/design.md section 5)."""
CACHE_TIERS: tuple[str, ...] = TIERS[:-1]
"""The tiers a prompt token can be served from (every tier but ``recompute``)."""
RESTORE_TIERS: tuple[str, ...] = CACHE_TIERS[1:]
"""The tiers a chunk is restored from into device pages (every cache tier but ``gpu``)."""


class DeclineReason(StrEnum):
    """The closed set of reasons a worker may decline an offer (on the wire: the value)."""

    WRONG_EPOCH = "wrong_epoch"
    WRONG_MODEL = "wrong_model"
    NO_CAPACITY = "no_capacity"
    OVER_CONTEXT_LIMIT = "over_context_limit"
    SHUTTING_DOWN = "shutting_down"
    STALE_ROUTE = "stale_route"


class FinishReason(StrEnum):
    """How an attempt (on the wire: the value) or a request ended."""

    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


class Assignment(msgspec.Struct, frozen=True, array_like=True):
    """One attempt of one request; attempts start at 1 and only grow."""

    request_id: ShortStr
    attempt: PositiveInt


class Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base of all wire messages: a ``type`` tag and the protocol version."""

    v: int = PROTOCOL_VERSION


class Sampling(msgspec.Struct, frozen=True, kw_only=True):
    """Sampling parameters; ``seed`` with the absolute token position seeds each draw."""

    temperature: NonNegFloat = 0.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    top_k: NonNegInt = 0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()


class RouteSegment(msgspec.Struct, frozen=True, array_like=True):
    """``chunks`` consecutive prefix chunks restored from ``tier`` (``source``: peer or bucket)."""

    tier: Tier
    chunks: NonNegInt
    source: ShortStr = ""


class Offer(Message, frozen=True, kw_only=True, tag="offer"):
    """Router -> worker: run this exact continuation.

    ``prompt`` already includes tokens delivered by earlier attempts;
    ``generated_before`` counts them, so the worker's sampling positions and the
    consumer's stream index continue where the last attempt stopped.
    ``route`` is the planned prefix: a list of tier segments covering
    ``sum(s.chunks)`` full chunks; the worker re-checks it against its pool.
    ``priority`` orders the worker's prefill queue: a prefill that has not
    started runs before every waiting one of higher priority value, ties in
    arrival order (vLLM's priority scheduling convention, lower first); a
    prefill that has started keeps its place. The default 0 everywhere is FIFO.
    ``traceparent`` (W3C, ``protocol.trace_context``; ``""``: none) is the router's span of this attempt, so
    the worker's spans join the request's trace; a first offer and a continuation carry it alike. A frame
    without it (an older router) decodes with ``""``.
    """

    assignment: Assignment
    worker_id: ShortStr
    epoch: NonNegInt
    model: ShortStr
    model_fingerprint: ShortStr = ""
    prompt: tuple[int, ...]
    max_new_tokens: PositiveInt
    generated_before: NonNegInt = 0
    sampling: Sampling = Sampling()
    route: tuple[RouteSegment, ...] = ()
    chain: tuple[ChunkKey, ...] = ()
    priority: Annotated[float, msgspec.Meta(ge=-1e15, le=1e15)] = 0.0
    traceparent: TraceParent = ""


class Cancel(Message, frozen=True, kw_only=True, tag="cancel"):
    """Router -> worker: fence this assignment now."""

    assignment: Assignment
    worker_id: ShortStr
    reason: ShortStr = ""


class OfferResult(Message, frozen=True, kw_only=True, tag="offer_result"):
    """Worker -> router: the offer was accepted, or declined with a reason."""

    assignment: Assignment
    worker_id: ShortStr
    epoch: NonNegInt
    accepted: bool
    reason: DeclineReason | None = None
    detail: ShortStr = ""


class Delta(Message, frozen=True, kw_only=True, tag="delta"):
    """Worker -> router: nonterminal tokens; ``seq`` counts deltas of this assignment from 0."""

    assignment: Assignment
    worker_id: ShortStr
    seq: NonNegInt
    tokens: tuple[int, ...]


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    """Token accounting of one attempt."""

    prompt_tokens: NonNegInt = 0
    cached_tokens: dict[Tier, NonNegInt] = {}
    recomputed_tokens: NonNegInt = 0
    generated_tokens: NonNegInt = 0


class Timings(msgspec.Struct, frozen=True, kw_only=True):
    """Seconds measured by the worker for one attempt."""

    queue_s: NonNegFloat = 0.0
    restore_s: NonNegFloat = 0.0
    prefill_s: NonNegFloat = 0.0
    ttft_s: NonNegFloat = 0.0
    inter_token_s: tuple[float, ...] = ()


class Result(Message, frozen=True, kw_only=True, tag="result"):
    """Worker -> router: terminal outcome of one assignment.

    ``tokens`` are all tokens this attempt generated (the deltas concatenated);
    ``error`` is set exactly when ``finish_reason == "error"``.
    """

    assignment: Assignment
    worker_id: ShortStr
    tokens: tuple[int, ...] = ()
    finish_reason: FinishReason
    usage: Usage = Usage()
    timings: Timings = Timings()
    error: str | None = None


class Heartbeat(Message, frozen=True, kw_only=True, tag="heartbeat"):
    """Worker -> router: low-rate observations (docs/design.md section 5).

    The registry accepts it only when ``(epoch, seq)`` is newer than the last
    accepted heartbeat of ``worker_id``.
    """

    worker_id: ShortStr
    epoch: NonNegInt
    seq: NonNegInt
    models: tuple[ShortStr, ...]
    model_fingerprints: tuple[ShortStr, ...] = ()
    pages_total: NonNegInt
    pages_free: NonNegInt
    pages_evictable: NonNegInt = 0
    pages_reserved: NonNegInt = 0
    page_tokens: PositiveInt = DEFAULT_PAGE_TOKENS
    chunk_tokens: PositiveInt = DEFAULT_CHUNK_TOKENS
    queue_delay_s: NonNegFloat = 0.0
    lower_tier_load_s: NonNegFloat = 0.0
    active_lanes: NonNegInt = 0
    max_lanes: PositiveInt = 1
    prefill_s_per_token: NonNegFloat = 0.0
    decode_s_per_token: NonNegFloat = 0.0
    prefill_chunk_tokens: NonNegInt = 0
    """Prompt tokens one device iteration prefills at most (chunked prefill); 0: not reported."""
    per_request_s: NonNegFloat = 0.0
    """Seconds a new request's first token waits per request already in flight on the worker (a vLLM engine's
    served fit); 0: not reported (a native worker's queue and interleaved decode steps count its lanes)."""
    restore_bytes_per_s: dict[Tier, NonNegFloat] = {}
    chunk_bytes_by_tier: dict[Tier, NonNegInt] = {}
    kv_bytes_per_token: NonNegInt = 0
    context_limit: PositiveInt = 8192
    peer_url: ShortStr = ""


class Residency(Message, frozen=True, kw_only=True, tag="residency"):
    """Worker -> router: chunk keys stored on / removed from one tier of one worker.

    With ``replace``, ``stored`` is everything the tier holds now (the first
    part of a snapshot; later parts of it add keys without ``replace``): the
    router forgets the worker's other keys on that tier. A worker sends a
    snapshot of each tier when a link to a router comes up.
    """

    worker_id: ShortStr
    epoch: NonNegInt
    seq: NonNegInt
    tier: Tier
    model: ShortStr = ""
    stored: tuple[ChunkKey, ...] = ()
    removed: tuple[ChunkKey, ...] = ()
    replace: bool = False


class Fenced(Message, frozen=True, kw_only=True, tag="fenced"):
    """Router -> worker: ``epoch`` of ``worker_id`` is fenced (its heartbeats stopped or its connection was lost).

    The router has re-routed that epoch's work and refuses its heartbeats for good; the worker comes back
    only in a newer epoch (docs/design.md section 3). The router sends it in answer to a heartbeat of a
    fenced epoch.
    """

    worker_id: ShortStr
    epoch: NonNegInt
    reason: ShortStr = ""


WireMessage = Offer | Cancel | OfferResult | Delta | Result | Heartbeat | Residency | Fenced
WIRE_TYPES: tuple[type[Message], ...] = (Offer, Cancel, OfferResult, Delta, Result, Heartbeat, Residency, Fenced)
