"""Routes over the residency index: which tier serves each chunk of a chain for one worker.

``walk_route`` reads the packed index values of a chain's leading keys (as
``ResidencyIndex.runs`` encodes them) and, per chunk, takes the fastest tier a worker reaches: its own gpu, ram or ssd,
a chunk a routed request is computing there (``PENDING``, when the caller allows it), a peer's ram or ssd, or
the shared object tier; it run-length encodes the result and stops at the first chunk nothing reaches, or where
pending chunks end (the worker re-matches them when the prefill starts and restores nothing after them).
A pending segment is a ``gpu`` segment whose source is ``PENDING_SOURCE``: it costs no restore and takes no
device page from the route's prefix (the worker reserves pages for it, then shares the predecessor's).
``boundaries_of`` lists the places a route may end (recompute everything, or after any segment), which are
the only places a linear cost can be lowest.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvrelay.core.planning.index import GPU, HELD_MASK, OBJECT, PENDING, RAM, SSD, ResidencyIndex
from kvrelay.protocol.messages import RouteSegment, Tier

PENDING_SOURCE = "pending"
"""The source of a route segment the worker does not hold yet: a request routed there is computing it."""


def is_pending(segment: RouteSegment) -> bool:
    return segment.source == PENDING_SOURCE and segment.tier == "gpu"


def offered_route(route: tuple[RouteSegment, ...]) -> tuple[RouteSegment, ...]:
    """What a worker is offered of a planned route: the segments before the first pending one."""
    for i, seg in enumerate(route):
        if is_pending(seg):
            return route[:i]
    return route


Run = tuple[int, int]
"""``(packed index value, consecutive chunks with it)``: chains are mostly long runs of equal values."""


def walk_route(
    runs: Sequence[Run],
    index: ResidencyIndex,
    shift: int | None,
    allowed_local: int,
    allow_peer: bool,
    allow_object: bool,
) -> tuple[RouteSegment, ...]:
    """Per chunk, the fastest tier a worker reaches, run-length encoded; stops at the first unreachable chunk.

    ``allowed_local`` masks the worker's own bits (``GPU | RAM | SSD``, and ``PENDING`` to count chunks routed
    there). A peer segment names the peer holding its last chunk (a holder of a later chunk of a chain almost
    always holds the earlier ones). Nothing follows a pending segment but more pending chunks.
    """
    peer_bits = index.all_peer_bits if allow_peer else 0
    if shift is not None:
        peer_bits &= ~(HELD_MASK << shift)
    object_bit = OBJECT if allow_object else 0
    kinds: list[str] = []
    counts: list[int] = []
    lasts: list[int] = []
    """Per segment: its tier (or "pending"), its chunks and the packed index value of its last chunk."""
    for value, count in runs:
        local = (value >> shift) & allowed_local if shift is not None else 0
        if local & GPU:
            kind = "gpu"
        elif local & RAM:
            kind = "ram"
        elif local & SSD:
            kind = "ssd"
        elif local & PENDING:
            kind = "pending"
        elif value & peer_bits:
            kind = "peer"
        elif value & object_bit:
            kind = "object"
        else:
            break
        if kinds and kinds[-1] == "pending" and kind != "pending":
            break
        if kinds and kinds[-1] == kind:
            counts[-1] += count
            lasts[-1] = value
        else:
            kinds.append(kind)
            counts.append(count)
            lasts.append(value)
    return tuple(_segment(t, n, v, index, peer_bits) for t, n, v in zip(kinds, counts, lasts, strict=True))


_TIERS: dict[str, Tier] = {"gpu": "gpu", "ram": "ram", "ssd": "ssd", "object": "object"}


def _segment(kind: str, chunks: int, last: int, index: ResidencyIndex, peer_bits: int) -> RouteSegment:
    if kind == "pending":
        return RouteSegment("gpu", chunks, PENDING_SOURCE)
    if kind == "peer":
        return RouteSegment("peer", chunks, index.first_peer(last, peer_bits))
    return RouteSegment(_TIERS[kind], chunks)


Boundary = tuple[int, int, tuple[tuple[Tier, int], ...], int]
"""``(cached tokens, gpu prefix tokens, chunks restored per lower tier, segments used)``."""


def boundaries_of(segments: tuple[RouteSegment, ...], chunk_tokens: int) -> list[Boundary]:
    """Recompute-everything, then the end of every segment of a route (a pending segment is cached, neither
    restored nor part of the resident gpu prefix)."""
    out: list[Boundary] = [(0, 0, (), 0)]
    cached = gpu = 0
    restored: dict[Tier, int] = {}
    for i, seg in enumerate(segments, 1):
        if seg.tier == "gpu":
            if cached == gpu and not is_pending(seg):
                gpu += seg.chunks * chunk_tokens
        else:
            restored[seg.tier] = restored.get(seg.tier, 0) + seg.chunks
        cached += seg.chunks * chunk_tokens
        out.append((cached, gpu, tuple(restored.items()), i))
    return out
