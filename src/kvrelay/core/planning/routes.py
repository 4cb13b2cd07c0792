"""Routes over the residency index: which tier serves each chunk of a chain for one worker.

``walk_route`` reads the packed index values of a chain's leading keys (as
``ResidencyIndex.runs`` encodes them) and, per chunk, takes the fastest tier a worker reaches: its own gpu, ram or ssd,
a peer's ram or ssd, or the shared object tier; it run-length encodes the
result and stops at the first chunk nothing reaches. ``boundaries_of`` lists
the places a route may end (recompute everything, or after any segment),
which are the only places a linear cost can be lowest.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvrelay.core.planning.index import GPU, LOCAL_MASK, OBJECT, RAM, SSD, ResidencyIndex
from kvrelay.protocol.messages import RouteSegment, Tier

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

    A peer segment names the peer holding its last chunk (a holder of a later
    chunk of a chain almost always holds the earlier ones).
    """
    peer_bits = index.all_peer_bits if allow_peer else 0
    if shift is not None:
        peer_bits &= ~(LOCAL_MASK << shift)
    object_bit = OBJECT if allow_object else 0
    tiers: list[Tier] = []
    counts: list[int] = []
    lasts: list[int] = []
    """Per segment: its tier, its chunks and the packed index value of its last chunk."""
    for value, count in runs:
        local = (value >> shift) & allowed_local if shift is not None else 0
        tier: Tier
        if local & GPU:
            tier = "gpu"
        elif local & RAM:
            tier = "ram"
        elif local & SSD:
            tier = "ssd"
        elif value & peer_bits:
            tier = "peer"
        elif value & object_bit:
            tier = "object"
        else:
            break
        if tiers and tiers[-1] == tier:
            counts[-1] += count
            lasts[-1] = value
        else:
            tiers.append(tier)
            counts.append(count)
            lasts.append(value)
    return tuple(
        RouteSegment(t, n, index.first_peer(v, peer_bits) if t == "peer" else "")
        for t, n, v in zip(tiers, counts, lasts, strict=True)
    )


Boundary = tuple[int, int, tuple[tuple[Tier, int], ...], int]
"""``(cached tokens, gpu prefix tokens, chunks restored per lower tier, segments used)``."""


def boundaries_of(segments: tuple[RouteSegment, ...], chunk_tokens: int) -> list[Boundary]:
    """Recompute-everything, then the end of every segment of a route."""
    out: list[Boundary] = [(0, 0, (), 0)]
    cached = gpu = 0
    restored: dict[Tier, int] = {}
    for i, seg in enumerate(segments, 1):
        if seg.tier == "gpu":
            if cached == gpu:
                gpu += seg.chunks * chunk_tokens
        else:
            restored[seg.tier] = restored.get(seg.tier, 0) + seg.chunks
        cached += seg.chunks * chunk_tokens
        out.append((cached, gpu, tuple(restored.items()), i))
    return out
