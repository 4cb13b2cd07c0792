"""What a simulated worker reports to the router: its heartbeat and its residency changes (pure)."""

from __future__ import annotations

from collections.abc import Mapping

from kvrelay.protocol.messages import Heartbeat, Residency, Tier
from kvrelay.sim.cache import GpuPool
from kvrelay.sim.cluster_config import ClusterConfig, WorkerSpec

TIERS: tuple[Tier, ...] = ("gpu", "ram", "ssd", "object")
"""The order in which one flush sends its per-tier messages."""


def heartbeat_of(
    worker_id: str,
    epoch: int,
    seq: int,
    cluster: ClusterConfig,
    spec: WorkerSpec,
    gpu: GpuPool,
    rates: Mapping[Tier, float],
    queued_tokens: int,
    lower_tier_load_s: float,
    decoding: int,
) -> Heartbeat:
    """The heartbeat of a worker with ``queued_tokens`` prompt tokens to prefill and ``decoding`` active lanes."""
    return Heartbeat(
        worker_id=worker_id,
        epoch=epoch,
        seq=seq,
        models=(cluster.model,),
        model_fingerprints=(cluster.fingerprint.hex(),),
        pages_total=gpu.pages_total,
        pages_free=max(gpu.free_pages, 0),
        pages_evictable=gpu.evictable_pages,
        page_tokens=cluster.page_tokens,
        chunk_tokens=cluster.chunk_tokens,
        queue_delay_s=queued_tokens * spec.prefill_s_per_token,
        lower_tier_load_s=lower_tier_load_s,
        active_lanes=decoding,
        max_lanes=spec.max_lanes,
        prefill_s_per_token=spec.prefill_s_per_token,
        decode_s_per_token=spec.decode_step(decoding),
        prefill_chunk_tokens=spec.prefill_chunk_tokens,
        restore_bytes_per_s=dict(rates),
        kv_bytes_per_token=cluster.kv_bytes_per_token,
        context_limit=spec.context_limit,
    )


def residency_messages(
    worker_id: str, epoch: int, last_seq: int, model: str, changes: Mapping[str, Mapping[bytes, bool]]
) -> list[Residency]:
    """One message per tier with changes (key -> stored or removed), numbered on from ``last_seq``."""
    out: list[Residency] = []
    for tier in TIERS:
        delta = changes.get(tier)
        if not delta:
            continue
        out.append(
            Residency(
                worker_id=worker_id,
                epoch=epoch,
                seq=last_seq + len(out) + 1,
                tier=tier,
                model=model,
                stored=tuple(k for k, s in delta.items() if s),
                removed=tuple(k for k, s in delta.items() if not s),
            )
        )
    return out
