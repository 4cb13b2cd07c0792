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
  engine never makes the router hold a request (``queue_delay``). A prefill counts whole until its first
  token: crediting the time since acceptance predicted better and served the loaded Gemma 3 slice's first
  tokens later, the rate under load being the error (docs/performance.md, "A vLLM engine's queue aged (tried,
  not kept)").

Counters that go back (the engine restarted) start the fit's window over without a point.

Once the worker has measured its own first tokens, the heartbeat reports their fit instead
(``served.ServedSpeeds``): the engine's fit is of a request alone in its step, and a burst on a shared CPU
took 20 to 50 times longer than it said.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

DECAY = 0.9
"""Weight kept by the fit per request observed since (about the last 10-20 requests count)."""
MIN_SPREAD = 0.05
"""Least weighted variance of the points' prompt lengths, relative to their mean squared, to fit a fixed cost."""
HISTORY_WEIGHT = 4.0
"""Requests the engine's history before the worker started counts as, at most."""
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
