"""Trace replay: one Mooncake-format trace through the simulator, and its metrics per policy.

Arrivals are ``start_s + timestamp / rate_scale`` (``start_s`` lets every worker
send its first heartbeat before traffic). TTFT is measured at the consumer: from
submission to the first delivered token. Prefix hits are the cached tokens (all
tiers) the workers reported for the attempts the router accepted, over all
prompt tokens of the trace, less those a request found from its own earlier attempts
(``sim.chunk_origins``; reported apart as ``own_attempt_cached_tokens``); the infinite-cache bounds, by blocks and by
routable chunks, are computed from the trace itself
(``trace.infinite_cache_bound``, ``trace.chunk_cache_bound``). No policy's hit
share can exceed the chunk-level one. ``reuse`` holds the router's decision-quality figures
(``core.router.reuse``): the prefix reuse available at each routing, what the chosen routes captured, what the
workers delivered (the same sum as the cached tokens above), and captured and delivered as shares of available.
``answered_once`` counts the requests that got exactly one outcome (all of them, unless one was lost);
``refused_with_retry_after`` those the router queue refused with a ``Retry-After`` (``queue_full``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from kvrelay.core.router.events import ErrorKind
from kvrelay.core.router.machine import RouterConfig
from kvrelay.core.router.reuse import reuse_figures
from kvrelay.sim.cluster_config import ClusterConfig
from kvrelay.sim.interpreter import Simulation
from kvrelay.sim.trace import (
    PromptSynthesizer,
    TraceRequest,
    chunk_cache_bound,
    infinite_cache_bound,
)


@dataclass(frozen=True, slots=True)
class ReplayOptions:
    seed: int = 0
    rate_scale: float = 1.0
    block_tokens: int = 512
    delta_tokens: int = 16
    start_s: float = 1.0
    drain_s: float = 3600.0
    """Logical time allowed after the last arrival before the replay is declared stuck."""
    log_path: str | None = None
    """Write the byte-stable event log here (large: one line per event)."""
    predict_on_route: bool = True
    """The router credits pending chunks (``RouterConfig.predict_on_route``); False to compare."""
    share_prefill: bool = True
    """Workers re-match a prefix when its prefill starts (``Simulation(rematch=...)``); False to compare."""


def _percentiles(values: list[float]) -> dict[str, float | None]:
    """Mean and percentiles (linear interpolation); None each when nothing completed."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    arr = np.asarray(values, dtype=float)
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {"mean": float(arr.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def replay(
    requests: list[TraceRequest],
    cluster: ClusterConfig,
    policy: str,
    options: ReplayOptions,
    router_config: RouterConfig | None = None,
) -> dict[str, Any]:
    """Replay ``requests`` under ``policy``; return the metrics (the JSON shape of ``kvrelay sim``)."""
    if options.rate_scale <= 0:
        raise ValueError(f"rate scale must be positive, got {options.rate_scale}")
    wall = time.perf_counter()
    config = router_config or RouterConfig(chunk_tokens=cluster.chunk_tokens)
    sim = Simulation(
        cluster,
        router_config=replace(config, predict_on_route=config.predict_on_route and options.predict_on_route),
        policy=policy,
        seed=options.seed,
        log=options.log_path is not None,
        delta_tokens=options.delta_tokens,
        rematch=options.share_prefill,
    )
    synth = PromptSynthesizer(cluster.fingerprint, options.block_tokens, cluster.chunk_tokens)
    last = 0.0
    for r in requests:
        rid = f"t{r.line}"
        at = options.start_s + r.timestamp_ms / 1000.0 / options.rate_scale
        last = max(last, at)
        sim.submit_later(rid, at, partial(synth.request, r, rid, cluster.model))
    finished = sim.run(until=last + options.drain_s)
    wall = time.perf_counter() - wall
    if options.log_path is not None:
        Path(options.log_path).write_bytes(sim.log_bytes())
    return _metrics(sim, requests, options, cluster.chunk_tokens, finished, wall)


def _metrics(
    sim: Simulation,
    requests: list[TraceRequest],
    options: ReplayOptions,
    chunk_tokens: int,
    finished: bool,
    wall_s: float,
) -> dict[str, Any]:
    prompt_tokens = sum(r.input_length for r in requests)
    ttfts: list[float] = []
    by_request: dict[str, float] = {}
    completed = cached = recomputed = own_cached = 0
    cached_by_tier: dict[str, int] = {}
    errors: dict[str, int] = {}
    answered_once = refused_with_retry = 0
    for c in sim.consumers.values():
        if not c.outcomes:
            continue
        o = c.outcomes[0]
        answered_once += len(c.outcomes) == 1
        if o.failure is not None and o.failure.kind is ErrorKind.QUEUE_FULL and (o.failure.retry_after_s or 0) >= 1:
            refused_with_retry += 1
        if o.finish_reason in ("stop", "length"):
            completed += 1
            if c.first_token_at is not None:
                ttfts.append(c.first_token_at - c.submitted_at)
                by_request[c.request_id] = ttfts[-1]
        else:
            kind = str(o.failure.kind if o.failure is not None else o.finish_reason)
            errors[kind] = errors.get(kind, 0) + 1
        for tier, n in o.usage.cached_tokens.items():
            cached_by_tier[tier] = cached_by_tier.get(tier, 0) + n
            cached += n
        own = sim.origins.own_tokens.get(c.request_id, 0)
        cached -= own
        own_cached += own
        recomputed += o.usage.recomputed_tokens
    bound = infinite_cache_bound(requests, options.block_tokens).token_share
    chunk_bound = chunk_cache_bound(requests, options.block_tokens, chunk_tokens).token_share
    share = cached / prompt_tokens if prompt_tokens else 0.0
    restored: dict[str, int] = {}
    workers: dict[str, dict[str, Any]] = {}
    for wid, w in sim.workers.items():
        st = w.stats
        for source, n in st.restored_bytes.items():
            restored[source] = restored.get(source, 0) + n
        workers[wid] = {
            "accepted": st.accepted,
            "finished": st.finished,
            "prefill_tokens": st.prefill_tokens,
            "generated_tokens": st.generated_tokens,
            "busy_s": round(st.busy_s, 6),
        }
    reuse = reuse_figures(sim.router.counters)
    busy = [w["busy_s"] for w in workers.values()]
    mean_busy = sum(busy) / len(busy) if busy else 0.0
    return {
        "requests": len(requests),
        "completed": completed,
        "ttft_s": _percentiles(ttfts),
        "prefix_hit_share": share,
        "infinite_cache_bound": bound,
        "bound_ratio": share / bound if bound else 0.0,
        "chunk_cache_bound": chunk_bound,
        "chunk_bound_ratio": share / chunk_bound if chunk_bound else 0.0,
        "recomputed_tokens": recomputed,
        "own_attempt_cached_tokens": own_cached,
        "reuse": {
            **reuse.as_dict(),
            "captured_share": reuse.captured_share,
            "delivered_share": reuse.delivered_share,
        },
        "cached_tokens_by_tier": dict(sorted(cached_by_tier.items())),
        "bytes_restored_by_tier": dict(sorted(restored.items())),
        "load_imbalance": max(busy) / mean_busy if mean_busy else 0.0,
        "per_worker": workers,
        "errors": errors,
        "answered_once": answered_once,
        "refused_with_retry_after": refused_with_retry,
        "drained": finished,
        "router_counters": dict(sorted(sim.router.counters.items())),
        "simulated_s": sim.now,
        "wall_s": wall_s,
        "ttft_samples_s": sorted(ttfts),
        "ttft_by_request_s": by_request,
    }


def with_workers(cluster: ClusterConfig, workers: int | None) -> ClusterConfig:
    """``cluster`` with ``workers`` workers (unchanged when None)."""
    return cluster if workers is None else replace(cluster, workers=workers)
