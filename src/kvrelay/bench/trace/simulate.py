"""The simulator's prediction for a trace replay: the same prompts, arrivals and budgets under logical time.

``predict_ttft`` submits each ``TracePrompt`` (its exact token ids, so the
chunk chains equal the real ones) at ``start_s + arrival_s`` to a ``Simulation``
of ``cluster`` under ``policy`` and returns the TTFT percentiles (linear
interpolation) and samples of the requests that produced a first token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np

from kvrelay.bench.trace.prompts import TracePrompt
from kvrelay.core.policies import DEFAULT_POLICY
from kvrelay.core.router.events import Request
from kvrelay.protocol.messages import Sampling
from kvrelay.sim.cluster_config import ClusterConfig
from kvrelay.sim.interpreter import Simulation


@dataclass(frozen=True, slots=True)
class Prediction:
    p50: float
    p90: float
    p99: float
    samples: tuple[float, ...]
    cached_tokens: int
    completed: int

    def as_dict(self) -> dict[str, float]:
        return {"p50": self.p50, "p90": self.p90, "p99": self.p99}


def pooled(predictions: Sequence[Prediction]) -> Prediction:
    """One prediction from several (samples and counts pooled, percentiles over the pooled samples)."""
    samples = tuple(x for p in predictions for x in p.samples)
    p50, p90, p99 = (float(v) for v in np.percentile(np.asarray(samples), [50, 90, 99]))
    return Prediction(
        p50, p90, p99, samples, sum(p.cached_tokens for p in predictions), sum(p.completed for p in predictions)
    )


def predict_ttft(
    prompts: Sequence[TracePrompt],
    cluster: ClusterConfig,
    policy: str = DEFAULT_POLICY,
    seed: int = 0,
    start_s: float = 1.0,
    drain_s: float = 3600.0,
) -> Prediction:
    """Replay ``prompts`` through the simulator (see the module docstring)."""
    sim = Simulation(cluster, policy=policy, seed=seed, log=False, delta_tokens=1)
    last = start_s
    for p in prompts:
        rid = f"t{p.index}"
        at = start_s + p.arrival_s
        last = max(last, at)
        sim.submit_later(
            rid, at, partial(Request, rid, cluster.model, p.token_ids, p.max_tokens, Sampling(seed=p.line))
        )
    sim.run(until=last + drain_s)
    ttfts: list[float] = []
    cached = 0
    for c in sim.consumers.values():
        if c.first_token_at is not None:
            ttfts.append(c.first_token_at - c.submitted_at)
        if c.outcomes:
            cached += sum(c.outcomes[0].usage.cached_tokens.values())
    if not ttfts:
        raise RuntimeError("the simulation produced no first token; check the calibration's costs")
    p50, p90, p99 = (float(v) for v in np.percentile(np.asarray(ttfts), [50, 90, 99]))
    return Prediction(p50, p90, p99, tuple(ttfts), cached, len(ttfts))
