"""kvrelay's policy: the lowest predicted time to first token over every tier boundary, counting the work.

Not necessarily the longest prefix: a slow tier or a long queue loses to a
shorter route or to recomputing (docs/design.md section 6). A recompute also takes
device time that later requests wait behind, which the request's own TTFT does
not count; that matters in proportion to how busy the cluster is. So the score
adds the candidate's prefill seconds times ``WORK_WEIGHT`` times the share of
workers with a non-empty queue (``Roster.busy_share``): on an idle cluster the
score is the predicted TTFT; on a saturated one a restore from a slow tier,
which runs beside the device, beats a slightly quicker recompute
(why this weight: docs/performance.md, "Work weight"). The work is priced per token
at the fleet's mean prefill rate, not the candidate worker's, so a slow worker is
not charged its slowness twice (``Scoring.work_s_per_token``; docs/performance.md,
"Work on a mixed fleet").

While fewer than half the workers have a queue (``CALM_BUSY_SHARE``), a
candidate on a worker whose queue is empty also counts the decode steps its
active lanes will interleave with the chunks of the prefill
(``candidates.Scoring.interleave``): a 50k-token prompt then goes to an idle
worker without lanes rather than to one that adds a decode step to each of its
chunks. On a busy cluster the lanes a prefill will meet are not known, so the
steps are not counted there (docs/performance.md, "Interleaved decode steps").
On a calm cluster (the same ``CALM_BUSY_SHARE``) scores within
``AFFINITY_MARGIN_S`` or ``AFFINITY_MARGIN_SHARE`` of the best, whichever is more, are
a tie: of those, on the workers with the fewest requests in flight (``WorkerLoad.active``: offered or
running there), the worker reusing the most cached tokens wins, then the lower score, then the lower worker
id. The fewest in flight first, because a tie means the cached tokens save less than the margin, while
what a worker's running requests cost a new one (a vLLM engine runs them in every step) is in the score only
as far as the worker prices it (``Heartbeat.per_request_s``, a noisy fit; docs/performance.md, "Requests in
flight as a term"): on two vLLM engines of a small model, where the margin exceeded the whole predicted TTFT,
65 to 71 of 101 requests went to one engine and the TTFT p90 was twice round robin's (docs/performance.md,
"Affinity among the least busy", which also says why the rule alone did not balance them). Each
worker's score holds its own measured fixed cost per request (a vLLM engine's
fit, ``engines/vllm/speeds``), and two identical engines on one CPU measured 9
and 28 ms for it: a difference of that size is noise, and on a small model it
outweighed the prefill a resident prefix saves, so the request went to the
engine without the prefix and recomputed it; a speed fitted from a few requests on a loaded machine is off
in proportion, so the margin grows with the score. On a busy cluster the work term
already charges the recompute, and the lowest score wins (a margin there moved
the simulated vLLM fleet's mean at 2x by 5 %; calm-only, no simulated figure
changed). The tie is among the routes planned: a worker pruned by the roster (``roster.plan_pruned``)
holds no local copy, so it could only tie on the shared tiers' tokens, which its planned group-mates reach as
well, but it may have fewer requests in flight, and then the rule does not see it (planning every route on a
calm cluster to see it lost simulated cells: docs/performance.md, same section). Ties go to the lower worker
id.

On a busy cluster of two speed classes (one worker's prefill per token ``SLOW_CLASS_RATIO`` times another's
or more, ``Heartbeat.prefill_s_per_token``), a request goes to the slowest worker whose score is within
``SPARE_FAST_MARGIN_SHARE`` of the lowest (then the lower score, then the lower worker id): a fast worker's queue
is what the long prompts arriving next wait behind, and only a fast worker serves them in time, so a request that
loses little on a slow worker leaves it to them (docs/performance.md, "Sparing the fast workers"). The margin is a
share, so a fitted rate that is off on a live fleet costs a request at most that share of its predicted TTFT. A
worker with no measured rate (0) leaves the rule out; on a fleet of one class it changes nothing.

The offer's priority (``Offer.priority``, the worker's prefill-queue order) is a
deadline: the request's arrival plus ``DEADLINE_STRETCH`` times its predicted
prefill seconds, earliest first. Under a backlog a short prompt then passes long
ones that arrived less than ``DEADLINE_STRETCH`` times its own prefill before it
(shortest-job-first with aging: a long prompt is passed only by prompts that are
much shorter, so it is never starved). With queues empty the order is moot.
The peers set no priority (their routers do not), so their workers stay FIFO.
A started prefill keeps its place (``prefill_order``): preempting it lets long
prompts starve (the stretch and that choice: docs/performance.md, "Deadline priority").
A user's requests waiting in the router queue go by the same deadline, except while over
``router.offered_load.LONG_BACKLOG_S`` of work per worker waits and the cluster is not overloaded: then by a
deadline at most ``PASS_LIMIT_S`` after their arrival (``hold_order``). On a fleet saturated for minutes the
full stretch let a long prompt be passed by every shorter one arriving up to five times its prefill later,
which made the tail; with a short backlog, or under overload where most requests must be refused and
shortest-first is what lets the admitted ones start in time, the full deadline does better
(docs/performance.md, "Router queue order under a long backlog").
"""

from __future__ import annotations

from collections.abc import Sequence

from kvrelay.core.planning.candidates import WorkerRoute, lowest_route
from kvrelay.core.planning.predicted_ttft import Candidate
from kvrelay.core.policies.base import Policy, RoutingContext
from kvrelay.core.router.queue import HoldOrder

WORK_WEIGHT = 2.0
AFFINITY_MARGIN_S = 0.05
CALM_BUSY_SHARE = 0.5
AFFINITY_MARGIN_SHARE = 0.25
DEADLINE_STRETCH = 5.0
SLOW_CLASS_RATIO = 2.0
SPARE_FAST_MARGIN_SHARE = 0.25
PASS_LIMIT_S = 5.0


class PredictedTTFT(Policy):
    name = "kvrelay"
    needs_all_routes = False
    work_weight = WORK_WEIGHT
    interleave_below_busy_share = CALM_BUSY_SHARE
    predicts_on_route = True

    def choose(self, ctx: RoutingContext) -> Candidate | None:
        """The lowest score; on a calm cluster, the most cached tokens among the routes within the affinity margin
        of it on the workers with the fewest requests in flight; on a busy one of two speed classes, the slowest
        worker within ``SPARE_FAST_MARGIN_SHARE`` of it."""
        routes = ctx.plan.routes
        if not routes:
            return None
        if ctx.busy_share >= CALM_BUSY_SHARE:
            return spare_fast_workers(routes).best
        best = min(r.best_score for r in routes)
        within = best + max(AFFINITY_MARGIN_S, AFFINITY_MARGIN_SHARE * best)
        in_flight = {r.worker_id: ctx.workers[r.worker_id].load.active for r in routes if r.best_score <= within}
        fewest = min(in_flight.values())
        least_busy = (r for r in routes if in_flight.get(r.worker_id) == fewest)
        return min(least_busy, key=lambda r: (-r.cached_tokens, r.best_score, r.worker_id)).best

    def priority(self, ctx: RoutingContext, chosen: Candidate) -> float:
        """The deadline ``arrived + DEADLINE_STRETCH * predicted prefill seconds``: earliest runs first."""
        return ctx.arrived + DEADLINE_STRETCH * chosen.terms.prefill_s

    def hold_order(self, arrived: float, work_s: float) -> HoldOrder:
        """The same deadline for a request waiting in the router queue, with the queue's work estimate; at
        most ``PASS_LIMIT_S`` after arrival under a long backlog."""
        deadline = arrived + DEADLINE_STRETCH * work_s
        return HoldOrder(deadline, min(deadline, arrived + PASS_LIMIT_S))


def spare_fast_workers(routes: Sequence[WorkerRoute]) -> WorkerRoute:
    """The route with the lowest score (ties: the lower worker id), unless routes within ``SPARE_FAST_MARGIN_SHARE``
    of it run on workers ``SLOW_CLASS_RATIO`` times slower to prefill than the fastest of them: then the slowest of
    those (ties: the lower score, the lower worker id). Rates of 0 (not measured yet) leave the lowest score."""
    best = lowest_route(routes)
    within = [r for r in routes if r.best_score <= best.best_score * (1.0 + SPARE_FAST_MARGIN_SHARE)]
    rates = [r.heartbeat.prefill_s_per_token for r in within]
    if min(rates) <= 0.0 or max(rates) < SLOW_CLASS_RATIO * min(rates):
        return best
    return min(within, key=lambda r: (-r.heartbeat.prefill_s_per_token, r.best_score, r.worker_id))
