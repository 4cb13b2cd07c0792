"""kvrelay's policy: the lowest predicted time to first token over every tier boundary, counting the work.

Not necessarily the longest prefix: a slow tier or a long queue loses to a
shorter route or to recomputing (DESIGN.md section 6). The score adds half of
the candidate's prefill seconds to its predicted TTFT (``WORK_WEIGHT``): a
recompute occupies the device that every later request waits behind, which
the request's own TTFT does not count, so between two nearly equal starts the
one that leaves more device time to others wins. Measured in the simulator on
the dev trace (`kvrelay sim --policy kvrelay`, seed 0, default cluster): at 1x
the recorded rate no decision changes; at 2x the mean TTFT drops from 1.353 s
(weight 0) to 1.343 s, with 0.75 at 1.339 s and 0.25 (1.353 s) or 1.0 (1.354 s)
no better. Ties go to the lower worker id, so the choice is deterministic.
"""

from __future__ import annotations

from kvrelay.controller.candidates import Candidate
from kvrelay.controller.policy import Policy, RoutingContext

WORK_WEIGHT = 0.5


class PredictedTTFT(Policy):
    name = "kvrelay"
    needs_all_routes = False
    work_weight = WORK_WEIGHT

    def choose(self, ctx: RoutingContext) -> Candidate | None:
        return ctx.plan.best()
