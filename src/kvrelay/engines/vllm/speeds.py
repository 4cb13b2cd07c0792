"""A vLLM engine's prefill speed and its queue, learned from the engine's own ``/metrics`` (pure).

What a vLLM worker's heartbeat reports (``Heartbeat.prefill_s_per_token``, ``decode_s_per_token``,
``queue_delay_s``) comes from here. The engine measures what the router needs without the noise of the
worker's own view (which starts before vLLM's queue and includes the HTTP hops):

- **prefill**: ``vllm:request_prefill_time_seconds`` (scheduled to first token: no time in vLLM's
  waiting queue) against ``vllm:request_prefill_kv_computed_tokens`` (prompt tokens computed, the cached
  ones left out), both observed once per finished request (``vllm/v1/metrics/loggers.py``). Between two
  polls the requests that finished give one point, their mean computed tokens ``x`` and mean prefill
  seconds ``y``, weighted by their number (a mean of ``fixed + rate * x`` is ``fixed + rate * mean x``, so
  points of several requests fit the same line). ``PrefillFit`` keeps an exponentially weighted least
  squares fit of ``y = fixed_s + s_per_token * x`` over those points (``DECAY`` per request): a short
  prompt's fixed cost (one engine step, the scheduler) no longer reads as a high cost per token, which made
  the worker predict 1.1-1.4 s for 0.4-0.8 s TTFTs. While the points' prompt lengths are too alike to
  tell the fixed cost from the rate (``MIN_SPREAD``), or the fit is unphysical (a negative fixed cost or
  rate), the rate is the fit through the origin (an upper bound when there is a fixed cost). The first
  totals a worker reads (the engine's history before it started) count as one point of at most
  ``HISTORY_WEIGHT`` requests, so a restarted worker starts from the engine's speed, not from a guess;
  where the worker's start-up probes succeed, their fit (``probe_fit``) replaces it.
- **the first token**: vLLM samples it at the end of the prefill's last step, so the time a request
  takes once scheduled is the fit itself, ``fixed_s + s_per_token * computed tokens``. The heartbeat's
  decode step, which the router adds once to every prediction, is therefore the fit's ``fixed_s`` (0 when
  the rate is the one through the origin, which holds the fixed cost), not a decode step's time: with a
  decode step added (the old default, 50 ms, on an engine that had decoded nothing yet), the engine
  holding a prompt's prefix lost to one that held none but had decoded before.
- **queue**: the uncached prompt tokens of the requests this worker sent that have no first token yet,
  times the prefill rate; none pending is an empty queue whatever vLLM's figures lag behind, so an idle
  engine never makes the router hold a request (``queue_delay``).

Counters that go back (the engine restarted) start the fit's window over without a point.

Once the worker has measured its own first tokens, the heartbeat reports their fit instead
(``ServedSpeeds``): the engine's fit is of a request alone in its step, and a burst on a shared CPU took
20 to 50 times longer than it said.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvrelay.core.worker.speeds import bounded_sample

DECAY = 0.9
"""Weight kept by the fit per request observed since (about the last 10-20 requests count)."""
MIN_SPREAD = 0.05
"""Least weighted variance of the points' prompt lengths, relative to their mean squared, to fit a fixed cost."""
HISTORY_WEIGHT = 4.0
"""Requests the engine's history before the worker started counts as, at most."""
MIN_SERVED = 4.0
"""Weight of served first tokens from which their fit replaces the engine's (``ServedSpeeds``)."""
SERVED_SPREAD_TOKENS = 256.0
"""Least spread (standard deviation) of the served points' prompt lengths from which their own rate counts: a
fit over a few dozen tokens, extrapolated to thousands, is its noise times a hundred."""
SERVED_TAU_S = 4.0
"""Seconds over which served points lose ``1 - 1/e`` of their weight (``ServedSpeeds.rested``)."""
DEFAULT_PREFILL_S_PER_TOKEN = 1e-3
"""Before the engine has finished a request: a CPU's order of magnitude for a model of a few hundred million
parameters; the first request replaces it."""


@dataclass(frozen=True, slots=True)
class EngineTotals:
    """Cumulative figures of one ``/metrics`` exposition (sums over the engine's indexes)."""

    prefill_requests: float = 0.0
    """``vllm:request_prefill_time_seconds_count``."""
    prefill_seconds: float = 0.0
    """``vllm:request_prefill_time_seconds_sum``."""
    prefill_tokens: float = 0.0
    """``vllm:request_prefill_kv_computed_tokens_sum``."""


@dataclass(frozen=True, slots=True)
class PrefillFit:
    """Weighted sums of the points ``(x, y)`` of the fit (see the module docstring); ``last``: the totals
    the next window starts from."""

    w: float = 0.0
    wx: float = 0.0
    wxx: float = 0.0
    wy: float = 0.0
    wxy: float = 0.0
    last: EngineTotals | None = None

    def observe(self, totals: EngineTotals) -> PrefillFit:
        """The fit with the window from ``last`` to ``totals`` added (the first totals: the history point)."""
        last = self.last
        if last is None:
            fit = self._add(totals.prefill_requests, totals.prefill_tokens, totals.prefill_seconds, HISTORY_WEIGHT)
            return replace(fit, last=totals)
        if totals.prefill_requests < last.prefill_requests:
            return replace(self, last=totals)  # the engine restarted: its counters began again
        fit = self._add(
            totals.prefill_requests - last.prefill_requests,
            totals.prefill_tokens - last.prefill_tokens,
            totals.prefill_seconds - last.prefill_seconds,
            None,
        )
        return replace(fit, last=totals)

    def point(self, tokens: float, seconds: float) -> PrefillFit:
        """The fit with one request's point added: ``tokens`` against ``seconds``."""
        return self._add(1, tokens, seconds, None)

    def _add(self, n: float, tokens: float, seconds: float, cap: float | None) -> PrefillFit:
        if n < 1 or tokens < 0 or seconds < 0:
            return self
        x, y = tokens / n, seconds / n
        weight = n if cap is None else min(n, cap)
        keep = DECAY**weight
        return replace(
            self,
            w=self.w * keep + weight,
            wx=self.wx * keep + weight * x,
            wxx=self.wxx * keep + weight * x * x,
            wy=self.wy * keep + weight * y,
            wxy=self.wxy * keep + weight * x * y,
        )

    def line(self) -> tuple[float, float] | None:
        """``(fixed_s, s_per_token)`` of the fit; None before a point with computed tokens."""
        if self.w <= 0 or self.wxx <= 0:
            return None
        resolved = self.resolved()
        if resolved is not None:
            return resolved
        rate = self.wxy / self.wxx
        return (0.0, rate) if rate > 0 else None

    def resolved(self) -> tuple[float, float] | None:
        """``(fixed_s, s_per_token)`` where the points tell the fixed cost from the rate (their prompt lengths
        spread by ``MIN_SPREAD`` and the line physical), else None."""
        if self.w <= 0 or self.wxx <= 0:
            return None
        mean_x, variance = self._moments()
        if variance <= MIN_SPREAD * mean_x * mean_x:
            return None
        rate = (self.wxy / self.w - mean_x * (self.wy / self.w)) / variance
        fixed = self.wy / self.w - rate * mean_x
        return (fixed, rate) if rate > 0 and fixed >= 0 else None

    def scaled(self, factor: float) -> PrefillFit:
        """The fit with every point's weight times ``factor``: the same line, held with less weight."""
        w, wx, wxx, wy, wxy = (factor * v for v in (self.w, self.wx, self.wxx, self.wy, self.wxy))
        return replace(self, w=w, wx=wx, wxx=wxx, wy=wy, wxy=wxy)

    def spread_tokens(self) -> float:
        """The weighted standard deviation of the points' prompt lengths (0 without points)."""
        return math.sqrt(max(0.0, self._moments()[1])) if self.w > 0 else 0.0

    def _moments(self) -> tuple[float, float]:
        """The weighted mean and variance of the points' prompt lengths (call with ``w > 0``)."""
        mean_x = self.wx / self.w
        return mean_x, self.wxx / self.w - mean_x * mean_x

    def through_mean(self, rate: float) -> tuple[float, float] | None:
        """The line of slope ``rate`` through the points' weighted mean (its fixed cost at least 0); None
        without points."""
        if self.w <= 0:
            return None
        return max(0.0, (self.wy - rate * self.wx) / self.w), rate

    @property
    def prefill_s_per_token(self) -> float:
        found = self.line()
        return found[1] if found is not None else DEFAULT_PREFILL_S_PER_TOKEN

    @property
    def fixed_s(self) -> float:
        """What a scheduled request takes beyond its computed tokens (the first token's term; module docstring)."""
        found = self.line()
        return found[0] if found is not None else 0.0


@dataclass(frozen=True, slots=True)
class ServedSpeeds:
    """What the heartbeat reports: the engine's own fit (``engine``) until this worker has measured
    ``MIN_SERVED`` first tokens of its own, then the fit of those (``served``): each request's time from
    acceptance to its first token against the uncached prompt tokens it waited for, its own and those of the
    requests admitted before it that had no first token yet. The engine's fit measures a request once
    scheduled, alone in its step on a quiet machine: beside a burst on a shared CPU it predicted 0.02-0.05 s
    for first tokens that took 1 s, so the router sent the whole burst to one engine. The served fit holds
    vLLM's queueing, its batching of prefills, the HTTP hop and the machine's load as they are.

    Served points of alike prompt lengths fix what such a request takes, not the rate: the fit through the
    origin charged their fixed cost per token, and a line fitted over 4 to 50 tokens, extrapolated to 2,000,
    multiplied their noise. A worker whose first points were the bench's warm-up requests (4-12 tokens,
    23-49 ms) predicted 0.44-0.92 s for 1,200 to 2,000-token prefills its engine did in 0.03-0.05 s, got no
    other request, and so never corrected it. Until the served points spread by ``SERVED_SPREAD_TOKENS``, the
    line keeps the engine's rate and goes through their mean (docs/performance.md, "Served fits of alike
    prompts").

    Served points also age with time (``rested``): a worker whose first tokens met a stall looked slow, the
    router sent it nothing more, and with no new point nothing corrected it (in a live replay one of two alike
    engines read a 0.256-s fixed cost after three stalled first tokens and got no request for the 10 s
    left). After about ``SERVED_TAU_S * ln(w / MIN_SERVED)`` seconds without a first token the served fit
    holds too little weight and the engine's own fit, that of a request alone in its step, counts again, as
    it should for an idle engine; the next first tokens it serves make the served fit again."""

    engine: PrefillFit = PrefillFit()
    served: PrefillFit = PrefillFit()
    served_at: float = -math.inf
    """The clock the served points' weights are aged to: that of the last one (``-inf``: none yet)."""

    def line(self) -> tuple[float, float] | None:
        """The served fit once it has ``MIN_SERVED`` points spread by ``SERVED_SPREAD_TOKENS`` that tell a rate;
        until then the line of the engine's rate through the served points' mean (see the class docstring)."""
        engine = self.engine.line()
        if self.served.w < MIN_SERVED:
            return engine
        if self.served.spread_tokens() >= SERVED_SPREAD_TOKENS:
            own = self.served.resolved()
            if own is not None:
                return own
        if engine is None:
            return self.served.line()
        return self.served.through_mean(engine[1])

    @property
    def prefill_s_per_token(self) -> float:
        found = self.line()
        return found[1] if found is not None else DEFAULT_PREFILL_S_PER_TOKEN

    @property
    def fixed_s(self) -> float:
        found = self.line()
        return found[0] if found is not None else 0.0

    def rested(self, now: float) -> ServedSpeeds:
        """The speeds at clock ``now``: the served points' weight times ``exp(-idle / SERVED_TAU_S)`` since the
        last one (see the class docstring)."""
        idle = now - self.served_at
        if not 0.0 < idle < math.inf:
            return self
        return replace(self, served=self.served.scaled(math.exp(-idle / SERVED_TAU_S)), served_at=now)

    def with_served(self, tokens: float, seconds: float, now: float) -> ServedSpeeds:
        """The speeds, ``rested`` to clock ``now``, with one served first token added: ``seconds`` from
        acceptance for ``tokens`` waited for, bounded as a native worker's forwards are
        (``core.worker.speeds.bounded_sample``: at most 4x what the speeds predict, never below 0.05 s). One
        stall (a request that met a busy moment) moves the fit a bounded step; a lasting slowdown raises the
        bound with every point. Unbounded, one 0.35-s first token of a 1,493-token prompt made an engine doing
        0.02 ms a token look ten times slower, and the router sent it almost nothing more, so nothing corrected
        it."""
        speeds = self.rested(now)
        fixed, rate = speeds.line() or (0.0, DEFAULT_PREFILL_S_PER_TOKEN)
        predicted = fixed + tokens * rate
        return replace(speeds, served=speeds.served.point(tokens, bounded_sample(seconds, predicted)), served_at=now)


def window_point(before: EngineTotals, after: EngineTotals) -> tuple[float, float] | None:
    """The mean computed tokens and prefill seconds of the requests that finished between two expositions;
    None when none did (or the engine restarted between them)."""
    n = after.prefill_requests - before.prefill_requests
    if n < 1:
        return None
    return (after.prefill_tokens - before.prefill_tokens) / n, (after.prefill_seconds - before.prefill_seconds) / n


def probe_fit(last: EngineTotals, samples: Sequence[Sequence[tuple[float, float]]]) -> PrefillFit:
    """The engine's fit from start-up probes: per group of probes of one prompt length, its quickest point
    (a stall only adds time: the other engines of a cluster probe at the same moment), and nothing of the
    engine's history (``last``: the totals the next window starts from). Groups without a point are skipped."""
    fit = PrefillFit(last=last)
    for group in samples:
        if group:
            tokens, seconds = min(group, key=lambda p: p[1])
            fit = fit.point(tokens, seconds)
    return fit


def queue_delay(pending_tokens: int, s_per_token: float) -> float:
    """Seconds a new request waits behind ``pending_tokens`` uncached prompt tokens not yet prefilled; 0 when none
    are pending (an idle engine)."""
    return max(0, pending_tokens) * s_per_token
