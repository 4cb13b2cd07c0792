"""What a vLLM worker's own first tokens say about its engine (pure): the speeds its heartbeat reports once it
has served a few.

A served first token is one point ``(x, n, y)``: ``x`` the uncached prompt tokens it waited for (its own and
those of the requests admitted before it with no first token yet), ``n`` the other requests in flight on
the worker when it was accepted, ``y`` the seconds from acceptance to the first token. ``ServedFit`` keeps
exponentially weighted sums of the points (``speeds.DECAY`` per point) and ``ServedSpeeds`` reads
``y = fixed_s + s_per_token * x + per_request_s * n`` from them.

The term in ``n`` is what the requests running on an engine cost a new one: vLLM runs every running request
in each step, so a request's prefill shares its steps with their decodes, and on a CPU one engine's
forward holds every core. Without it the heartbeat's queue counted only prompt tokens not yet prefilled;
on two engines of a small model, the router predicted 0.05 s for first tokens the busier engine served in
0.20 s, and sent it more (docs/performance.md, "Requests in flight as a term"). The router multiplies
``per_request_s`` by its own count of requests in flight on the worker, which a heartbeat does not delay
(``core.planning.predicted_ttft.queue_of``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvrelay.core.worker.speeds import bounded_sample
from kvrelay.engines.vllm.speeds import DECAY, DEFAULT_PREFILL_S_PER_TOKEN, PrefillFit

MIN_SERVED = 4.0
"""Weight of served first tokens from which their fit replaces the engine's."""
SERVED_SPREAD_TOKENS = 256.0
"""Least spread (standard deviation) of the served points' prompt lengths from which their own rate counts: a
fit over a few dozen tokens, extrapolated to thousands, is its noise times a hundred."""
MIN_CROWD_SPREAD = 0.5
"""Least spread (standard deviation) of the served points' requests in flight from which their cost is fitted."""
MAX_CROWD_CORRELATION = 0.95
"""Most correlation of the points' tokens waited and requests in flight at which both slopes are fitted at once;
above it the two cannot be told apart and the rate is fitted alone first."""
SERVED_TAU_S = 4.0
"""Seconds over which served points lose ``1 - 1/e`` of their weight (``ServedSpeeds.rested``)."""

Line = tuple[float, float, float]
"""``(fixed_s, s_per_token, per_request_s)``."""


@dataclass(frozen=True, slots=True)
class ServedFit:
    """Weighted sums of the served points ``(x, n, y)`` (module docstring); ``tokens``: those of ``(x, y)``."""

    tokens: PrefillFit = PrefillFit()
    wn: float = 0.0
    wnn: float = 0.0
    wxn: float = 0.0
    wny: float = 0.0

    @property
    def w(self) -> float:
        return self.tokens.w

    def point(self, tokens: float, seconds: float, in_flight: int = 0) -> ServedFit:
        """The fit with one served first token added: ``tokens`` waited for, ``in_flight`` other requests."""
        if tokens < 0 or seconds < 0:
            return self
        n = float(max(0, in_flight))
        return ServedFit(
            self.tokens.point(tokens, seconds),
            self.wn * DECAY + n,
            self.wnn * DECAY + n * n,
            self.wxn * DECAY + tokens * n,
            self.wny * DECAY + n * seconds,
        )

    def scaled(self, factor: float) -> ServedFit:
        """Every point's weight times ``factor``: the same fit, held with less weight."""
        return ServedFit(
            self.tokens.scaled(factor), factor * self.wn, factor * self.wnn, factor * self.wxn, factor * self.wny
        )

    def resolved(self) -> tuple[float, float] | None:
        """The ``(fixed_s, s_per_token)`` line of the tokens alone, where it is physical (``PrefillFit.resolved``)."""
        return self.tokens.resolved()

    def spread_tokens(self) -> float:
        return self.tokens.spread_tokens()

    def crowded(self, fixed: float, rate: float, joint: bool) -> Line:
        """``(fixed, rate)`` with the requests in flight as a third term, where the points tell its cost: both
        slopes at once when ``joint`` (the tokens spread) and the two are not too correlated, else the cost of a
        request in flight over what ``rate`` leaves; ``(fixed, rate, 0)`` where the points do not spread in
        requests in flight or the fit is unphysical."""
        f = self.tokens
        w = f.w
        mx, mn, my = f.wx / w, self.wn / w, f.wy / w
        sxx, snn = f.wxx / w - mx * mx, self.wnn / w - mn * mn
        sxn, sxy, sny = self.wxn / w - mx * mn, f.wxy / w - mx * my, self.wny / w - mn * my
        if snn < MIN_CROWD_SPREAD**2:
            return fixed, rate, 0.0
        if joint and sxx > 0.0 and sxn * sxn < MAX_CROWD_CORRELATION**2 * sxx * snn:
            det = sxx * snn - sxn * sxn
            b, c = (sxy * snn - sny * sxn) / det, (sny * sxx - sxy * sxn) / det
            a = my - b * mx - c * mn
            if b > 0.0 and c > 0.0 and a >= 0.0:
                return a, b, c
        c = (sny - rate * sxn) / snn
        a = my - rate * mx - c * mn
        return (a, rate, c) if c > 0.0 and a >= 0.0 else (fixed, rate, 0.0)


@dataclass(frozen=True, slots=True)
class ServedSpeeds:
    """What the heartbeat reports: the engine's own fit (``engine``) until this worker has measured
    ``MIN_SERVED`` first tokens of its own, then the fit of those (``served``; module docstring). The engine's
    fit measures a request once scheduled, alone in its step on a quiet machine: beside a burst on a shared
    CPU it predicted 0.02-0.05 s for first tokens that took 1 s, so the router sent the whole burst to one
    engine. The served fit holds vLLM's queueing, its batching of prefills, the HTTP hop and the machine's
    load as they are.

    Served points of alike prompt lengths fix what such a request takes, not the rate: the fit through the
    origin charged their fixed cost per token, and a line fitted over 4 to 50 tokens, extrapolated to 2,000,
    multiplied their noise. A worker whose first points were the bench's warm-up requests (4-12 tokens,
    23-49 ms) predicted 0.44-0.92 s for 1,200 to 2,000-token prefills its engine did in 0.03-0.05 s, got no
    other request, and so never corrected it. Until the served points spread by ``SERVED_SPREAD_TOKENS``, the
    line keeps the engine's rate and goes through their mean (docs/performance.md, "Served fits of alike
    prompts"); the cost of a request in flight is then fitted over what that rate leaves.

    Served points also age with time (``rested``): a worker whose first tokens met a stall looked slow, the
    router sent it nothing more, and with no new point nothing corrected it (in a live replay one of two alike
    engines read a 0.256-s fixed cost after three stalled first tokens and got no request for the 10 s
    left). After about ``SERVED_TAU_S * ln(w / MIN_SERVED)`` seconds without a first token the served fit
    holds too little weight and the engine's own fit, that of a request alone in its step, counts again, as
    it should for an idle engine; the next first tokens it serves make the served fit again."""

    engine: PrefillFit = PrefillFit()
    served: ServedFit = ServedFit()
    served_at: float = -math.inf
    """The clock the served points' weights are aged to: that of the last one (``-inf``: none yet)."""

    def terms(self) -> Line | None:
        """``(fixed_s, s_per_token, per_request_s)``: the served fit once it has ``MIN_SERVED`` points (its own
        rate where they spread by ``SERVED_SPREAD_TOKENS`` and tell one, else the engine's rate through their
        mean); the engine's line with no cost per request before; None before any line."""
        engine = self.engine.line()
        if self.served.w < MIN_SERVED:
            return None if engine is None else (*engine, 0.0)
        spread = self.served.spread_tokens() >= SERVED_SPREAD_TOKENS
        own = self.served.resolved() if spread else None
        if own is not None:
            return self.served.crowded(*own, joint=True)
        if engine is None:
            line = self.served.tokens.line()
            return None if line is None else self.served.crowded(*line, joint=False)
        through = self.served.tokens.through_mean(engine[1])
        return None if through is None else self.served.crowded(*through, joint=False)

    def reported(self) -> Line:
        """``terms``, or before any line ``(0, DEFAULT_PREFILL_S_PER_TOKEN, 0)``: what the heartbeat reports."""
        return self.terms() or (0.0, DEFAULT_PREFILL_S_PER_TOKEN, 0.0)

    def line(self) -> tuple[float, float] | None:
        """``(fixed_s, s_per_token)`` of ``terms``."""
        found = self.terms()
        return None if found is None else (found[0], found[1])

    @property
    def prefill_s_per_token(self) -> float:
        return self.reported()[1]

    @property
    def fixed_s(self) -> float:
        return self.reported()[0]

    @property
    def per_request_s(self) -> float:
        """Seconds a new request's first token waits per request already in flight on the worker."""
        return self.reported()[2]

    def rested(self, now: float) -> ServedSpeeds:
        """The speeds at clock ``now``: the served points' weight times ``exp(-idle / SERVED_TAU_S)`` since the
        last one (see the class docstring)."""
        idle = now - self.served_at
        if not 0.0 < idle < math.inf:
            return self
        return replace(self, served=self.served.scaled(math.exp(-idle / SERVED_TAU_S)), served_at=now)

    def with_served(self, tokens: float, seconds: float, now: float, in_flight: int = 0) -> ServedSpeeds:
        """The speeds, ``rested`` to clock ``now``, with one served first token added: ``seconds`` from
        acceptance for ``tokens`` waited for with ``in_flight`` other requests on the worker, bounded as a
        native worker's forwards are (``core.worker.speeds.bounded_sample``: at most 4x what the speeds predict,
        never below 0.05 s). One stall (a request that met a busy moment) moves the fit a bounded step; a
        lasting slowdown raises the bound with every point. Unbounded, one 0.35-s first token of a
        1,493-token prompt made an engine doing 0.02 ms a token look ten times slower, and the router sent it
        almost nothing more, so nothing corrected it."""
        speeds = self.rested(now)
        fixed, rate, per_request = speeds.reported()
        predicted = fixed + tokens * rate + per_request * max(0, in_flight)
        point = speeds.served.point(tokens, bounded_sample(seconds, predicted), in_flight)
        return replace(speeds, served=point, served_at=now)
