"""kvrelay's policy: the lowest predicted time to first token over every tier boundary.

Not necessarily the longest prefix: a slow tier or a long queue loses to a
shorter route or to recomputing (DESIGN.md section 6). Ties go to the lower
worker id, so the choice is deterministic.
"""

from __future__ import annotations

from kvrelay.controller.candidates import Candidate
from kvrelay.controller.policy import Policy, RoutingContext


class PredictedTTFT(Policy):
    name = "kvrelay"
    needs_all_routes = False

    def choose(self, ctx: RoutingContext) -> Candidate | None:
        return ctx.plan.best()
