"""llm-d's inference scheduler with its built-in profile: a weighted sum of prefix, queue and KV-utilisation scorers.

The EPP still falls back to this profile when it is given no configuration
(llm-d/llm-d-router commit ebab6879, ``pkg/epp/config/loader/defaults.go``:
queue 2, kv-cache utilisation 2, prefix 3); llm-d's well-lit guides now deploy
the prefix-cache-affinity filter and the token-load scorer instead (policy
``llm_d``, ``llmd_affinity``).

Source followed (read, not copied):

- kubernetes-sigs/gateway-api-inference-extension
  ``config/charts/inferencepool/templates/epp-config.yaml`` (``default-plugins.yaml``,
  the ``default`` scheduling profile, commit 0ae94dfb lines 36-43): ``queue-scorer`` weight 2,
  ``kv-cache-utilization-scorer`` weight 2, ``prefix-cache-scorer`` weight 3; the
  llm-d guide ``llm-d/llm-d guides/inference-scheduling`` deploys that file.
- same repository, ``pkg/epp/scheduling/framework/plugins/scorer/queue.go``: per
  endpoint ``(max_q - q) / (max_q - min_q)`` over the candidates' waiting queue
  sizes, 1.0 for all when they are equal;
  ``.../scorer/kvcache_utilization.go``: ``1 - KVCacheUsagePercent``;
  ``.../plugins/multi/prefix/plugin.go``: matched blocks / request blocks.
- llm-d/llm-d-kv-cache ``pkg/kvcache/kvblock_scorer.go`` (``LongestPrefixScorer``,
  used by the KV-event driven precise prefix scorer): consecutive blocks from the
  start, each counted at the highest weight of the tiers that hold it;
  ``pkg/kvcache/backend.go`` (``DefaultKVCacheBackendConfig``): gpu 1.0, cpu 0.8
  (commit daca7db4); a later revision of the same function adds storage 0.3.
- Picking: the highest weighted sum wins; equal sums are broken at random
  (the max-score picker shuffles first).

Defaults: weights prefix 3, queue 2, kv-utilisation 2; tier weights gpu 1.0,
ram ("cpu") 0.8, ssd ("storage") 0.3.

Signals, as the real scheduler has them: the prefix scorer reads residency
events (the worker's own gpu/ram/ssd run from the start of the chain; a peer's
or the object tier's copy is not the worker's); a block is one chunk. The
queue depth is the requests the router sent to the worker that are not yet
decoding (``load.active - heartbeat.active_lanes``: vLLM's waiting requests as
the scheduler would scrape them). KV utilisation is pages in use over pages in
the last heartbeat (``pages_total - pages_free - pages_evictable``; vLLM counts
cached-but-free blocks as free). Each scorer is clamped to [0, 1]. Ties draw
from the seeded ``ctx.rng``. The chosen worker is offered its cheapest route
(``route.best``), as for every policy, so the comparison is of worker
selection alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvrelay.core.planning.predicted_ttft import Candidate, WorkerView
from kvrelay.core.policies.base import Policy, RoutingContext
from kvrelay.core.policies.dynamo_kv import local_prefix_chunks


def _clamp(x: float) -> float:
    return min(1.0, max(0.0, x))


@dataclass(frozen=True, slots=True)
class LlmdScores:
    """One worker's scorer outputs (each in [0, 1]) and their weighted sum."""

    prefix: float
    queue: float
    kv_free: float
    total: float


class LlmdScorer(Policy):
    name = "llm_d_scorers"

    def __init__(
        self,
        prefix_weight: float = 3.0,
        queue_weight: float = 2.0,
        kv_weight: float = 2.0,
        tier_weights: dict[str, float] | None = None,
    ) -> None:
        self.prefix_weight = prefix_weight
        self.queue_weight = queue_weight
        self.kv_weight = kv_weight
        self.tier_weights = tier_weights or {"gpu": 1.0, "ram": 0.8, "ssd": 0.3}

    @staticmethod
    def waiting(view: WorkerView) -> int:
        return max(0, view.load.active - view.heartbeat.active_lanes)

    def scores(self, ctx: RoutingContext) -> dict[str, LlmdScores]:
        """Every eligible worker's scores for this request."""
        queues = {r.worker_id: self.waiting(ctx.workers[r.worker_id]) for r in ctx.routes}
        low, high = min(queues.values(), default=0), max(queues.values(), default=0)
        total_blocks = len(ctx.chain)
        out: dict[str, LlmdScores] = {}
        for r in ctx.routes:
            hb = ctx.workers[r.worker_id].heartbeat
            held = local_prefix_chunks(r.segments)
            weighted = sum(self.tier_weights.get(t, 0.0) * n for t, n in held.items())
            prefix = _clamp(weighted / total_blocks) if total_blocks else 0.0
            queue = 1.0 if high == low else _clamp((high - queues[r.worker_id]) / (high - low))
            used = max(0, hb.pages_total - hb.pages_free - hb.pages_evictable)
            kv_free = _clamp(1.0 - used / hb.pages_total) if hb.pages_total else 0.0
            total = self.prefix_weight * prefix + self.queue_weight * queue + self.kv_weight * kv_free
            out[r.worker_id] = LlmdScores(prefix, queue, kv_free, total)
        return out

    def choose(self, ctx: RoutingContext) -> Candidate | None:
        if not ctx.routes:
            return None
        scores = self.scores(ctx)
        best = max(s.total for s in scores.values())
        tied = sorted(w for w, s in scores.items() if s.total == best)
        winner = tied[0] if len(tied) == 1 else ctx.rng.choice(tied)
        return next(r for r in ctx.routes if r.worker_id == winner).best
