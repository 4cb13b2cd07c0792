"""One accepted assignment on a simulated worker, what the worker did, and what one device iteration costs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

from kvrelay.protocol.messages import Offer, Tier, Timings, Usage
from kvrelay.sim.admission import AdmissionPlan
from kvrelay.sim.calibration import CalibratedWorkerSpec
from kvrelay.sim.cluster_config import WorkerSpec


@dataclass(slots=True)
class Work:
    """One accepted assignment on the runtime."""

    offer: Offer
    plan: AdmissionPlan
    reserved_pages: int
    pinned: list[bytes]
    accepted_at: float
    prefill_left: int
    computed: list[bytes] = field(default_factory=list)
    """Chain keys still to compute, in order (the plan's, less those re-matched at prefill start)."""
    rematched: int = 0
    """Chunks found resident when the prefill started (filled by another request meanwhile), not computed."""
    generated: int = 0
    emitted: int = 0
    in_flight: bool = False
    fenced: bool = False
    restore_done_at: float = 0.0
    prefill_started_at: float | None = None
    first_token_at: float | None = None


@dataclass(slots=True)
class WorkerStats:
    """What one worker did, over all its epochs."""

    accepted: int = 0
    finished: int = 0
    prefill_tokens: int = 0
    generated_tokens: int = 0
    busy_s: float = 0.0
    restored_bytes: dict[str, int] = field(default_factory=dict)
    rematched_chunks: int = 0
    deferred: int = 0
    """Times a prefill waited for another request to finish its next chunk."""


def iteration_order(queue: Sequence[Work]) -> list[Work]:
    """The order in which a worker's prefills take an iteration's budget, as the live runtime plans it
    (``worker.runtime.iteration``, ``Job.place``): started prefills by acceptance time, and each waiting one (in
    ``queue`` order) before the started ones accepted after it, so a request that waited for its restore is not
    passed by a prefill that started meanwhile."""
    started = sorted((w for w in queue if w.prefill_started_at is not None), key=lambda w: w.accepted_at)
    order: list[Work] = []
    i = 0
    for work in queue:
        if work.prefill_started_at is not None:
            continue
        while i < len(started) and started[i].accepted_at <= work.accepted_at:
            order.append(started[i])
            i += 1
        order.append(work)
    return order + started[i:]


def iteration_s(spec: WorkerSpec, decode_lanes: int, prefill_tokens: int) -> float:
    """Seconds of one device iteration; a measured spec (``CalibratedWorkerSpec``) prices it itself."""
    if isinstance(spec, CalibratedWorkerSpec):
        return spec.iteration_s(decode_lanes, prefill_tokens)
    return (spec.decode_step(decode_lanes) if decode_lanes else 0.0) + prefill_tokens * spec.prefill_s_per_token


def usage_of(work: Work, chunk_tokens: int) -> Usage:
    """What ``work``'s result reports it used: its plan's cached tokens by tier, the chunks it re-matched on the
    device at its prefill's start counted as gpu hits, the rest recomputed."""
    plan = work.plan
    cached = dict(plan.cached_tokens)
    shared = work.rematched * chunk_tokens
    if shared:
        cached["gpu"] = cached.get("gpu", 0) + shared
    return Usage(
        prompt_tokens=len(work.offer.prompt),
        cached_tokens=cast(dict[Tier, int], cached),
        recomputed_tokens=plan.uncached_tokens - shared,
        generated_tokens=work.generated,
    )


def timings_of(work: Work, chunk_tokens: int, prefill_s_per_token: float) -> Timings:
    """``work``'s timings: its wait for the device after acceptance and restore, its restore, the prefill of
    what it computed, and accepted to first token."""
    start = work.prefill_started_at if work.prefill_started_at is not None else work.accepted_at
    first = work.first_token_at if work.first_token_at is not None else start
    return Timings(
        queue_s=max(0.0, start - max(work.accepted_at, work.restore_done_at)),
        restore_s=work.plan.restore_s,
        prefill_s=(work.plan.uncached_tokens - work.rematched * chunk_tokens) * prefill_s_per_token,
        ttft_s=first - work.accepted_at,
    )
