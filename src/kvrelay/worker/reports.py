"""What a native worker reports to its routers, read off its page pool, runtime and chunk tiers.

``heartbeat_of`` builds the heartbeat's figures: the pool's pages, the bytes of each
local chunk tier, the runtime's lanes and its learned speeds, relaxed after a rest
(``core.worker.speeds.rested``), as the queue delay and per-token prices
(``core.worker.speeds.heartbeat_speeds``: the queue drains in forwards of the budget the
lanes allow now, a new prompt pays the step spread over the token budget).
``snapshot_parts`` lists what each local tier (gpu, ram, ssd) holds, in parts of at
most ``SNAPSHOT_KEYS`` keys for ``Residency.replace`` messages.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvrelay.core.worker.speeds import heartbeat_speeds, rested
from kvrelay.protocol.messages import Heartbeat, Tier
from kvrelay.worker.admission import WorkerIdentity
from kvrelay.worker.page_pool import PagePool
from kvrelay.worker.runtime.loop import PagedRuntime

SNAPSHOT_KEYS = 8192
"""Chunk keys per part of a residency snapshot (about 150 KB on the wire)."""


def local_tiers(restorer: object) -> list[Any]:
    """The local chunk tiers (ram, ssd) of a restore handler's tier stack; none without a chunk store."""
    stack = getattr(restorer, "stack", None)
    return [] if stack is None else list(stack.local_tiers)


def heartbeat_of(
    me: WorkerIdentity,
    seq: int,
    pool: PagePool,
    runtime: PagedRuntime,
    restorer: object,
    queued_tokens: int,
    now: float,
    restore_bytes_per_s: Mapping[Tier, float],
    kv_bytes_per_token: int,
    peer_url: str,
) -> Heartbeat:
    """Heartbeat ``seq`` of worker ``me`` at monotonic second ``now``, with ``queued_tokens`` prompt tokens still
    to write (see the module docstring)."""
    decoding, policy = runtime.num_decoding, runtime.policy
    learned = rested(runtime.speeds, now)
    speeds = heartbeat_speeds(learned, queued_tokens, decoding, policy.token_budget, policy.budget(decoding))
    return Heartbeat(
        worker_id=me.worker_id,
        epoch=me.epoch,
        seq=seq,
        models=(me.model,),
        model_fingerprints=(me.fingerprint.hex(),),
        pages_total=pool.num_pages,
        pages_free=pool.num_free,
        pages_evictable=pool.num_evictable,
        pages_reserved=pool.num_reserved,
        chunk_bytes_by_tier={tier.name: tier.used_bytes for tier in local_tiers(restorer)},
        page_tokens=pool.page_tokens,
        chunk_tokens=me.chunk_tokens,
        queue_delay_s=speeds.queue_delay_s,
        active_lanes=runtime.num_active,
        max_lanes=policy.num_lanes,
        prefill_s_per_token=speeds.prefill_s_per_token,
        decode_s_per_token=speeds.decode_s_per_token,
        prefill_chunk_tokens=policy.token_budget,
        restore_bytes_per_s=dict(restore_bytes_per_s),
        kv_bytes_per_token=kv_bytes_per_token,
        context_limit=me.context_limit,
        peer_url=peer_url,
    )


def snapshot_parts(pool: PagePool, restorer: object) -> list[tuple[Tier, tuple[bytes, ...], bool]]:
    """``(tier, keys, replace)`` per snapshot message: each tier's keys in parts of ``SNAPSHOT_KEYS``, the first
    part replacing what the router holds for that tier (so an empty tier still sends one part), the rest adding."""
    tiers: list[tuple[Tier, list[bytes]]] = [("gpu", pool.resident_keys())]
    tiers += [(tier.name, tier.keys()) for tier in local_tiers(restorer)]
    return [
        (name, tuple(keys[start : start + SNAPSHOT_KEYS]), start == 0)
        for name, keys in tiers
        for start in range(0, max(len(keys), 1), SNAPSHOT_KEYS)
    ]
