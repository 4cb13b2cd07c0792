"""Which order a model's router queue serves by: its offered load and its backlog (pure).

``OfferedLoad`` is an exponentially weighted rate of the predicted prefill seconds of new requests, with
time constant ``WINDOW_S``: each arrival adds ``work_s / WINDOW_S`` and the rate decays by
``exp(-dt / WINDOW_S)``. ``ratio`` divides it by the workers' capacity in seconds of work per second
(``capacity``: each worker counts its speed relative to the fastest, whose rate prices the work).

``long_backlog``: the queue serves by its requests' long-backlog keys (``queue.HoldOrder``; kvrelay's
passes a long prompt for at most ``PASS_LIMIT_S``) while more than ``LONG_BACKLOG_S`` of work per worker
waits and the offered load is under ``OVERLOAD_RATIO`` times the capacity; by the usual keys (kvrelay's:
shortest-first with aging) otherwise. A fleet saturated for minutes and one offered three times what it
serves both hold tens of seconds of work, so the backlog alone cannot tell them apart; the arrival rate
does, from the first seconds. Under overload most requests must be refused, and shortest-first is what
lets the admitted ones start in time; on a saturated fleet that keeps up on the whole, passing a long
prompt without bound made the tail; with a short backlog passing costs little (docs/performance.md,
"Router queue order under a long backlog"). The overload rule follows "adaptive LIFO" in Facebook's "Fail
at Scale" (Maurer, ACM Queue 13(8), 2015): the requests that can still be served in time first, once the
system cannot keep up.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

WINDOW_S = 5.0
"""Time constant of the arrival rate (seconds). In a first version of the rule, without ``LONG_BACKLOG_S``,
a window of 20 or 60 s crossed ``OVERLOAD_RATIO`` only after the backlog had been built in the long-backlog
order, which cost most of the overload's goodput (docs/performance.md)."""
OVERLOAD_RATIO = 2.0
"""Offered load over capacity from which the queue serves by the usual keys whatever its backlog. On the
development trace the simulated 2x regimes peak at 1.6 to 2.3 (99th percentiles 1.3 to 1.9) and 6x on
the default cluster runs at 2.4 (median) to 6."""
LONG_BACKLOG_S = 20.0
"""Predicted work per worker waiting in the queue above which a backlog is long (seconds)."""


@dataclass(frozen=True, slots=True)
class OfferedLoad:
    """The arrival rate of predicted prefill work (module docstring)."""

    rate: float = 0.0
    """Seconds of work per second, as of ``at``."""
    at: float = -math.inf

    def rate_at(self, now: float) -> float:
        """The rate decayed to ``now`` (no arrival since ``at``)."""
        if self.at == -math.inf or now <= self.at:
            return self.rate
        return self.rate * math.exp(-(now - self.at) / WINDOW_S)

    def arrived(self, now: float, work_s: float) -> OfferedLoad:
        """The load after a request of ``work_s`` predicted prefill seconds arrived at ``now``."""
        return OfferedLoad(self.rate_at(now) + max(0.0, work_s) / WINDOW_S, max(now, self.at))

    def ratio(self, now: float, capacity: float) -> float:
        """The rate at ``now`` over ``capacity`` (seconds of work per second); 0 with no capacity."""
        return self.rate_at(now) / capacity if capacity > 0.0 else 0.0


def capacity(prefill_s_per_token: Iterable[float]) -> float:
    """Seconds of work per second the workers of these rates serve, work priced at the fastest rate: each
    worker counts ``fastest / its rate``; a worker with no measured rate (0) counts 1."""
    rates = list(prefill_s_per_token)
    fastest = min((r for r in rates if r > 0.0), default=0.0)
    return sum(fastest / r if r > 0.0 else 1.0 for r in rates)


def long_backlog(load: OfferedLoad, now: float, waiting_s: float, prefill_s_per_token: Iterable[float]) -> bool:
    """Whether a queue holding ``waiting_s`` of predicted work, for workers of these rates, serves by its
    long-backlog keys at ``now`` (module docstring)."""
    cap = capacity(prefill_s_per_token)
    return cap > 0.0 and waiting_s > LONG_BACKLOG_S * cap and load.ratio(now, cap) < OVERLOAD_RATIO
