"""Mooncake's Conductor: the lowest predicted TTFT, fetching a remote prefix past a balancing threshold.

Source followed (read, not copied):

- Qin et al., "Mooncake: Trading More Storage for Less Computation", FAST '25,
  section 6.1 and Algorithm 1 (KVCache-centric scheduling): for every prefill
  instance, ``prefix_len`` is its local prefix match and ``best_prefix_len`` the
  longest match anywhere; ``T_queue`` is the sum of the prefill times queued on
  the instance; if ``best_prefix_len / prefix_len < kvcache_balancing_threshold``
  the instance prefills from its local prefix (TTFT = T_queue + T_prefill),
  otherwise it fetches the missing ``best_prefix_len - prefix_len`` and prefills
  from there (TTFT = T_transfer + T_queue + T_prefill); the instance with the
  lowest TTFT wins. Section 6.2: the fetch doubles as hot-spot replication.
- kvcache-ai/Mooncake issue #749 (maintainer's answer): the threshold alone
  decides whether to transfer (transfer time is not compared with recompute),
  and T_queue is the sum of queued prefill execution times.

Defaults: ``kvcache_balancing_threshold`` 1.5. Neither the paper nor the
released code (``mooncake-conductor/`` has the prefix indexer only) publishes a
value, so this one is ours: fetch when the remote prefix is at least one and a
half times the local one. An instance with no local prefix fetches whenever
anything is reachable (the ratio is unbounded).

Mapping to kvrelay: the local prefix is the worker's own gpu/ram/ssd run from
the start of the chain; the remote prefix is the whole reachable route (a
peer's ram/ssd and the shared object tier, Mooncake Store's role). Each
branch's TTFT is Algorithm 1's sum, ``T_transfer + T_queue + T_prefill``,
built from the same observations kvrelay's model uses: the transfer of the
restored tiers (``terms.restore_s``; local lower tiers are loaded into the
device too), the worker's queued prefill (the router's drained backlog,
``candidates.queue_of``) and the prefill of the uncached tokens. It has no
term for a transfer overlapping the queue or for decode steps interleaved with
the prefill, as the paper has none. This policy dictates the restore route
(local boundary or full route), not only the worker. SLO-based early rejection (HTTP 429) is not modelled: the
router parks requests instead. Ties go to the lower worker id.
"""

from __future__ import annotations

from kvrelay.core.planning import candidates as cand
from kvrelay.core.planning import predicted_ttft
from kvrelay.core.planning.candidates import WorkerRoute
from kvrelay.core.planning.predicted_ttft import Candidate
from kvrelay.core.policies.base import Policy, RoutingContext
from kvrelay.core.policies.dynamo_kv import LOCAL_TIERS


def local_segments(route: WorkerRoute) -> int:
    """How many leading segments of the route are the worker's own tiers."""
    n = 0
    for seg in route.segments:
        if seg.tier not in LOCAL_TIERS:
            break
        n += 1
    return n


class MooncakeConductor(Policy):
    name = "mooncake"

    def __init__(self, kvcache_balancing_threshold: float = 1.5) -> None:
        self.threshold = kvcache_balancing_threshold

    def fetches_remote(self, route: WorkerRoute) -> bool:
        """Whether the worker takes the whole reachable route rather than its local prefix."""
        used = local_segments(route)
        local = sum(s.chunks for s in route.segments[:used])
        reach = sum(s.chunks for s in route.segments)
        if reach <= local:
            return False
        return local == 0 or reach / local >= self.threshold

    def candidate(self, ctx: RoutingContext, route: WorkerRoute) -> Candidate | None:
        """The worker's candidate for the branch Algorithm 1 takes (None if it does not fit)."""
        want = len(route.segments) if self.fetches_remote(route) else local_segments(route)
        max_new = ctx.request.max_new_tokens - (len(ctx.prompt) - len(ctx.request.prompt))
        view = ctx.workers[route.worker_id]
        feasible = cand.alternatives(route, view, len(ctx.prompt), max_new, ctx.now)
        fitting = [c for c in feasible if len(c.route) <= want]
        return max(fitting, key=lambda c: len(c.route), default=None)

    def ttft(self, ctx: RoutingContext, c: Candidate) -> float:
        """Algorithm 1's estimate: ``T_transfer + T_queue + T_prefill``."""
        queue = predicted_ttft.queue_of(ctx.workers[c.worker_id], ctx.now)
        return sum(c.terms.restore_s.values()) + queue + c.terms.prefill_s

    def choose(self, ctx: RoutingContext) -> Candidate | None:
        options = [c for c in (self.candidate(ctx, r) for r in ctx.routes) if c is not None]
        if not options:
            return None
        return min(options, key=lambda c: (self.ttft(ctx, c), c.worker_id))
