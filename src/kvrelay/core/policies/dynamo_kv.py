"""NVIDIA Dynamo's KV router: the lowest overlap-adjusted prefill + decode block cost.

Current version checked (read, not copied): ai-dynamo/dynamo
``lib/kv-router/src/scheduling/selector/default.rs`` (commit 07a6c9ce,
``DefaultWorkerScorer::worker_logit``): ``logit = prefill_load_scale *
max(0, raw_prefill_blocks - overlap_credit_blocks) + decode_cost_blocks +
decode_active_request_weight * active_requests`` with ``overlap_credit_blocks =
overlap_score_credit * decay * device + host_cache_hit_weight * host +
disk_cache_hit_weight * disk + shared_cache_multiplier * shared``;
``lib/kv-router/src/scheduling/config.rs`` (commit 0243c51b, ``KvRouterConfig``
defaults): credit 1.0, prefill load scale 1.0, host 0.75, disk 0.25,
temperature 0.0, decay and shared-cache multiplier 0 (off), predict-on-route
side index off (``router_predicted_ttl_secs`` None); the Python CLI
(``components/src/dynamo/common/configuration/groups/kv_router_args.py``, commit fde23ef6) has
the same defaults. That is the formula below, so there is no older variant to
keep: with the decay and the shared credit off, the current cost is the one this
policy computed before.

Sources first followed:

- ai-dynamo/dynamo ``lib/kv-router/src/scheduling/selector/reference.rs``
  (``DefaultWorkerScorer::worker_logit``): per worker,
  ``overlap_credit = overlap_score_credit * device_blocks
  + host_cache_hit_weight * host_blocks + disk_cache_hit_weight * disk_blocks``;
  ``raw_prefill_blocks = (active_prefill_tokens + isl) / block_size``;
  ``logit = prefill_load_scale * max(0, raw_prefill_blocks - overlap_credit)
  + decode_blocks`` (+ ``decode_active_request_weight * active_requests``, 0 by
  default); with ``router_temperature`` 0 the lowest logit wins.
- ai-dynamo/dynamo ``lib/kv-router/src/scheduling/overlap.rs``
  (``cache_hit_weight_for_tier``, ``build_overlap_scores_response``): device
  1.0, host-pinned ``host_cache_hit_weight``, disk/external
  ``disk_cache_hit_weight``; host blocks are those extending the device prefix,
  disk blocks those extending the host prefix.
- ai-dynamo/dynamo ``lib/kv-router/src/scheduling/config.rs``
  (``default_host_cache_hit_weight`` 0.75, ``default_disk_cache_hit_weight``
  0.25, ``default_prefill_load_scale`` 1.0) and ``docs/router/kv_cache_routing.md`` ("--kv-overlap-score-weight
  ... Defaults to 1", "--router-temperature ... 0 (default)"); the decode term is
  the worker's potential decode blocks: its active blocks plus this request's
  new blocks (``docs/design_docs/router_design.md``, "Potential Active Blocks").

Defaults: ``overlap_score_credit`` 1.0, ``prefill_load_scale`` 1.0,
``host_cache_hit_weight`` 0.75, ``disk_cache_hit_weight`` 0.25,
``router_temperature`` 0 (deterministic).

Signals, as the real router has them: cached blocks per tier come from
residency events (the route segments; only the worker's own gpu/ram/ssd run
from the start of the chain counts, each chunk at its fastest local tier; a
peer's or the object tier's copy is not the worker's and gets no credit).
A block is one chunk (``ctx.chunk_tokens``, the residency granularity). Active
blocks are the pages in use in the last heartbeat
(``pages_total - pages_free - pages_evictable``) plus the pages of offers the
router sent and that the heartbeat does not reflect yet; active prefill tokens
are the router's own outstanding prefill work (``load.outstanding_s`` over the
prefill seconds per token). Ties go to the lower worker id (Dynamo breaks them
by indexer tree size, then at random). The chosen worker is offered its
cheapest route (``route.best``), as for every policy, so the comparison is of
worker selection alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvrelay.core.planning.candidates import WorkerRoute
from kvrelay.core.planning.predicted_ttft import Candidate
from kvrelay.core.policies.base import Policy, RoutingContext
from kvrelay.protocol.messages import RouteSegment

LOCAL_TIERS = ("gpu", "ram", "ssd")


def local_prefix_chunks(segments: tuple[RouteSegment, ...]) -> dict[str, int]:
    """Chunks per local tier in the worker's own run of tiers from the start of the chain."""
    out = {tier: 0 for tier in LOCAL_TIERS}
    for seg in segments:
        if seg.tier not in out:
            break
        out[seg.tier] += seg.chunks
    return out


@dataclass(frozen=True, slots=True)
class DynamoCost:
    """One worker's cost, term by term (in blocks)."""

    raw_prefill_blocks: float
    overlap_credit: float
    decode_blocks: float
    logit: float


class DynamoKV(Policy):
    name = "dynamo"

    def __init__(
        self,
        prefill_load_scale: float = 1.0,
        overlap_score_credit: float = 1.0,
        host_cache_hit_weight: float = 0.75,
        disk_cache_hit_weight: float = 0.25,
    ) -> None:
        self.prefill_load_scale = prefill_load_scale
        self.tier_weights = {"gpu": overlap_score_credit, "ram": host_cache_hit_weight, "ssd": disk_cache_hit_weight}

    def cost(self, ctx: RoutingContext, route: WorkerRoute) -> DynamoCost:
        view = ctx.workers[route.worker_id]
        hb, load = view.heartbeat, view.load
        block = ctx.chunk_tokens
        cached = local_prefix_chunks(route.segments)
        credit = sum(self.tier_weights[t] * n for t, n in cached.items())
        active_prefill = load.outstanding_s / hb.prefill_s_per_token if hb.prefill_s_per_token > 0 else 0.0
        raw_prefill = (active_prefill + len(ctx.prompt)) / block
        pages_in_use = max(0, hb.pages_total - hb.pages_free - hb.pages_evictable)
        active_blocks = max(0, pages_in_use + load.pages_held) * hb.page_tokens / block
        new_blocks = max(0, -(-len(ctx.prompt) // block) - cached["gpu"])
        decode = active_blocks + new_blocks
        logit = self.prefill_load_scale * max(0.0, raw_prefill - credit) + decode
        return DynamoCost(raw_prefill, credit, decode, logit)

    def choose(self, ctx: RoutingContext) -> Candidate | None:
        if not ctx.routes:
            return None
        return min(ctx.routes, key=lambda r: (self.cost(ctx, r).logit, r.worker_id)).best
