"""kvrelay's policy: the lowest predicted time to first token over every tier boundary, counting the work.

Not necessarily the longest prefix: a slow tier or a long queue loses to a
shorter route or to recomputing (docs/design.md section 6). A recompute also takes
device time that later requests wait behind, which the request's own TTFT does
not count; that matters in proportion to how busy the cluster is. So the score
adds the candidate's prefill seconds times ``WORK_WEIGHT`` times the share of
workers with a non-empty queue (``Roster.busy_share``): on an idle cluster the
score is the predicted TTFT; on a saturated one a restore from a slow tier,
which runs beside the device, beats a slightly quicker recompute.

Measured in the simulator on the dev trace (seed 0, `kvrelay sim --policy all`),
against the weight 0 (pure predicted TTFT): on the default cluster no decision
changes at 1x or 2x the recorded rate; on `configs/cluster-slow-tiers.toml`
(ssd and object slower than recomputing) the mean TTFT goes from 0.656 to
0.654 s at 1x and from 1.394 to 1.355 s at 2x, where pure TTFT lost to
Mooncake's Conductor (1.362 s). A flat weight of 2 instead gives 0.675 s at 1x
(worse) and 1.361 s at 2x.

While fewer than half the workers have a queue (``CALM_BUSY_SHARE``), a
candidate on a worker whose queue is empty also counts the decode steps its
active lanes will interleave with the chunks of the prefill
(``candidates.Scoring.interleave``): a 50k-token prompt then goes to an idle
worker without lanes rather than to one that adds a 25 ms step to each of its
seven 8k chunks. On the default cluster (dev trace, seed 0) this lowers the mean
TTFT from 0.6547 to 0.6469 s and p99 from 5.167 to 5.150 s at 1x, and the mean from
1.3487 to 1.3461 s at 2x, p99 unchanged. Counted on a busy cluster too, the 2x p99
went to 11.35 s: the overload burst that sets it reacts chaotically to any change of
placement, and there the lanes a prefill will meet are not known anyway. Ties go
to the lower worker id.

The offer's priority (``Offer.priority``, the worker's prefill-queue order) is a
deadline: the request's arrival plus ``DEADLINE_STRETCH`` times its predicted
prefill seconds, earliest first. Under a backlog a short prompt then passes long
ones that arrived less than ``DEADLINE_STRETCH`` times its own prefill before it
(shortest-job-first with aging: a long prompt is passed only by prompts that are
much shorter, so it is never starved). With queues empty the order is moot.
The peers set no priority (their routers do not), so their workers stay FIFO.
Measured on the dev trace, 2x rate (the 1x figures do not change), mean / p99
TTFT: FIFO 1.346 / 10.32 s; stretch 2: 1.249 / 10.05; 5: 1.225 / 9.98;
10: 1.219 / 10.06; 20: 1.236 / 11.02; pure shortest-first 1.200 / 10.20. The
same with prefills preempted by shorter newcomers (not done: a started prefill
keeps its place, ``prefill_order``): 1.185 / 12.59 at stretch 5, the long
prompts starve.
"""

from __future__ import annotations

from kvrelay.core.policies.base import Policy, RoutingContext
from kvrelay.core.planning.predicted_ttft import Candidate

WORK_WEIGHT = 2.0
CALM_BUSY_SHARE = 0.5
DEADLINE_STRETCH = 5.0


class PredictedTTFT(Policy):
    name = "kvrelay"
    needs_all_routes = False
    work_weight = WORK_WEIGHT
    interleave_below_busy_share = CALM_BUSY_SHARE

    def choose(self, ctx: RoutingContext) -> Candidate | None:
        return ctx.plan.best()

    def priority(self, ctx: RoutingContext, chosen: Candidate) -> float:
        """The deadline ``arrived + DEADLINE_STRETCH * predicted prefill seconds``: earliest runs first."""
        return ctx.arrived + DEADLINE_STRETCH * chosen.terms.prefill_s
