"""A vLLM engine's speeds learned from its /metrics totals (``engines.vllm.speeds``) and from its served first
tokens (``engines.vllm.served``), without an engine."""

from __future__ import annotations

import random

import pytest

from kvrelay.engines.vllm.served import MIN_SERVED, SERVED_TAU_S, ServedSpeeds
from kvrelay.engines.vllm.speeds import (
    DEFAULT_PREFILL_S_PER_TOKEN,
    EngineTotals,
    PrefillFit,
    probe_fit,
    queue_delay,
    window_point,
)


def run(points: list[tuple[int, float]], start: EngineTotals | None = None) -> PrefillFit:
    """The fit after one poll per request ``(computed tokens, prefill seconds)``, from ``start`` (or empty)."""
    totals = start or EngineTotals()
    fit = PrefillFit().observe(totals)
    for tokens, seconds in points:
        n, total_s, total_tokens = totals.prefill_requests, totals.prefill_seconds, totals.prefill_tokens
        totals = EngineTotals(n + 1, total_s + seconds, total_tokens + tokens)
        fit = fit.observe(totals)
    return fit


def test_a_fixed_cost_per_request_is_not_read_as_a_cost_per_token() -> None:
    # 20 ms of every prefill is fixed (one engine step), 30 us per computed token: the old per-token average
    # over short prompts (first token / uncached tokens) read 64 tokens as 0.34 ms a token, 11x too much.
    seed = 20261202
    rng = random.Random(seed)
    points = [(n, 0.02 + 3e-5 * n) for n in (rng.choice((64, 128, 960, 1500, 2000)) for _ in range(30))]
    fit = run(points)
    line = fit.line()
    assert line is not None, f"seed {seed}"
    fixed, rate = line
    assert fixed == pytest.approx(0.02, rel=1e-6) and rate == pytest.approx(3e-5, rel=1e-6), f"seed {seed}"
    assert (fit.fixed_s, fit.prefill_s_per_token) == pytest.approx((0.02, 3e-5), rel=1e-6)


def test_a_poll_window_of_several_requests_is_one_point_of_their_means() -> None:
    fit = PrefillFit().observe(EngineTotals())
    fit = fit.observe(EngineTotals(2, (0.01 + 1e-4 * 100) + (0.01 + 1e-4 * 900), 1000))
    fit = fit.observe(EngineTotals(3, 0.01 + 0.01 + 0.1 + 0.01 + 1e-4 * 2000, 3000))
    assert fit.line() == pytest.approx((0.01, 1e-4))


def test_alike_prompts_fall_back_to_the_rate_through_the_origin() -> None:
    fit = run([(1000, 0.05)] * 5)
    assert fit.line() == pytest.approx((0.0, 5e-5))
    assert (fit.fixed_s, fit.prefill_s_per_token) == pytest.approx((0.0, 5e-5))


def test_the_engine_holding_a_prefix_is_predicted_sooner_than_one_that_decoded_more() -> None:
    # The routing test's case: one engine finished a single prefill of 385 tokens (behind the router's back),
    # the other many requests. The first token's term must not hide the 384 cached tokens.
    holder = run([(385, 0.02)])
    busy = run([(n, 0.015 + 3e-5 * n) for n in (100, 400, 800, 1600) * 3])
    prompt, cached = 387, 384
    on_holder = holder.fixed_s + (prompt - cached) * holder.prefill_s_per_token
    on_busy = busy.fixed_s + prompt * busy.prefill_s_per_token
    assert on_holder < on_busy


def test_an_unphysical_fit_falls_back_to_the_rate_through_the_origin() -> None:
    # longer prompts finishing sooner (noise, or a prefix the metric did not see): a negative rate
    fit = run([(100, 0.2), (2000, 0.1)])
    fixed, rate = fit.line() or (None, None)
    assert fixed == 0.0 and rate is not None and rate > 0


def test_no_data_keeps_the_defaults_and_the_history_counts_as_one_point() -> None:
    empty = PrefillFit().observe(EngineTotals())
    assert (empty.fixed_s, empty.prefill_s_per_token) == (0.0, DEFAULT_PREFILL_S_PER_TOKEN)
    history = PrefillFit().observe(EngineTotals(500, 500 * 0.04, 500 * 1000))
    assert (history.fixed_s, history.prefill_s_per_token) == pytest.approx((0.0, 4e-5))
    # the history weighs as a few requests: ten requests at another speed outweigh it
    fit = run([(n, 2e-5 * n) for n in (500, 1500) * 5], start=history.last)
    assert fit.prefill_s_per_token == pytest.approx(2e-5, rel=0.15)


def test_counters_that_go_back_start_a_new_window_without_a_point() -> None:
    fit = run([(1000, 0.03), (200, 0.014)])
    before = fit.line()
    restarted = fit.observe(EngineTotals(1, 0.5, 10))  # a restarted engine's first request
    assert restarted.line() == before
    assert restarted.last == EngineTotals(1, 0.5, 10)


def test_an_idle_engine_has_no_queue() -> None:
    assert queue_delay(0, 1.0) == 0.0
    assert queue_delay(-5, 1.0) == 0.0
    assert queue_delay(2000, 3e-5) == pytest.approx(0.06)


def test_served_first_tokens_replace_the_engines_fit_once_there_are_enough() -> None:
    # The engine alone: 10 ms fixed, 10 us a token. Served under a burst: 30 ms fixed, 150 us a token of what
    # each request waited for (its own and the unprefilled tokens ahead of it).
    engine = run([(64, 0.01 + 64e-5), (1024, 0.01 + 1024e-5), (512, 0.01 + 512e-5)])
    speeds = ServedSpeeds(engine)
    waited = [800, 2400, 3100, 900, 1700, 4000]
    for k, tokens in enumerate(waited):
        before = speeds.prefill_s_per_token
        speeds = ServedSpeeds(engine, speeds.served.point(tokens, 0.03 + 150e-6 * tokens))
        if k + 1 < MIN_SERVED:
            assert speeds.prefill_s_per_token == before == pytest.approx(1e-5)
    assert speeds.prefill_s_per_token == pytest.approx(150e-6)
    assert speeds.fixed_s == pytest.approx(0.03)


def test_served_points_of_alike_short_prompts_keep_the_engines_rate() -> None:
    # The engine: 10 ms fixed, 15 us a token. The first served requests are a client's warm-up: 4 to 45 tokens
    # waited for, 23 to 49 ms to the first token. They say what a short request takes, not what a long one
    # does: fitted alone they read as half a millisecond a token, a 2,000-token prompt predicted at a second.
    engine = run([(32, 0.01 + 32 * 15e-6), (512, 0.01 + 512 * 15e-6)])
    speeds = ServedSpeeds(engine)
    for tokens, seconds in ((4, 0.023), (11, 0.049), (22, 0.049), (34, 0.047), (45, 0.047)):
        speeds = ServedSpeeds(engine, speeds.served.point(tokens, seconds))
    assert speeds.served.resolved() is not None  # a physical line over 4-45 tokens: 0.5 ms a token
    fixed, rate = speeds.line() or (0.0, 0.0)
    assert rate == pytest.approx(15e-6)
    mean_x = (4 + 11 + 22 + 34 + 45) / 5
    assert fixed + rate * mean_x == pytest.approx(0.043, abs=0.003)  # what the served requests took
    assert fixed + rate * 2000 < 0.1
    # Once the served prompts spread, their own fit is the figure.
    for tokens in (1500, 300, 2000):
        speeds = ServedSpeeds(engine, speeds.served.point(tokens, 0.03 + 40e-6 * tokens))
    assert speeds.served.resolved() is not None and speeds.line() == speeds.served.resolved()
    assert speeds.prefill_s_per_token > 20e-6


def test_start_up_probes_keep_the_quickest_of_each_length_and_none_of_the_history() -> None:
    # An engine that served bursts before: its history reads 2 ms a token. Three probes of each length, one of
    # each stalled by another engine probing at the same moment.
    history = EngineTotals(400, 400 * 2e-3 * 900, 400 * 900)
    assert window_point(history, history) is None
    after = EngineTotals(401, history.prefill_seconds + 0.3, history.prefill_tokens + 512)
    assert window_point(history, after) == pytest.approx((512, 0.3))
    samples = [
        [(32, 0.01 + 32e-5), (32, 0.2), (32, 0.01 + 32e-5)],
        [(512, 0.5), (512, 0.01 + 512e-5), (512, 0.012 + 512e-5)],
        [],
    ]
    fit = probe_fit(history, samples)
    assert fit.last == history
    assert fit.line() == pytest.approx((0.01, 1e-5))
    assert PrefillFit().observe(history).prefill_s_per_token == pytest.approx(2e-3)  # what the history alone said


def test_one_stalled_first_token_moves_the_served_fit_a_bounded_step_and_a_lasting_slowdown_shows() -> None:
    engine = run([(32, 0.01 + 32 * 2e-5), (512, 0.01 + 512 * 2e-5)])
    speeds = ServedSpeeds(engine)
    for tokens in (900, 100, 1700, 400):
        speeds = speeds.with_served(tokens, 0.01 + 2e-5 * tokens, 0.0)
    assert speeds.prefill_s_per_token == pytest.approx(2e-5)
    stalled = speeds.with_served(1493, 0.35, 0.0)  # predicted 0.04 s: counted as 0.16 s at most
    unbounded = ServedSpeeds(engine, speeds.served.point(1493, 0.35))

    def at_1770(s: ServedSpeeds) -> float:
        return s.fixed_s + 1770 * s.prefill_s_per_token

    assert at_1770(stalled) < 2 * at_1770(speeds) < at_1770(unbounded)
    # Every request 20 times slower than the fit says: within a few points the fit says so too.
    slow = speeds
    for k in range(12):
        tokens = (600, 1800, 300)[k % 3]
        slow = slow.with_served(tokens, 20 * (0.01 + 2e-5 * tokens), 0.0)
    assert slow.prefill_s_per_token > 10 * 2e-5


def test_a_served_fit_a_stall_inflated_rests_back_to_the_engine_fit_once_no_first_token_comes() -> None:
    engine = run([(32, 0.01 + 32 * 2e-5), (512, 0.01 + 512 * 2e-5)])
    speeds, clock = ServedSpeeds(engine), 0.0
    for tokens in (900, 100, 1700, 400, 1200, 60):
        clock += 0.25
        speeds = speeds.with_served(tokens, 0.01 + 2e-5 * tokens, clock)
    for tokens in (158, 31, 1199):  # one stall, met by the three requests in flight
        clock += 0.01
        speeds = speeds.with_served(tokens, 0.95, clock)

    def at_100(s: ServedSpeeds) -> float:
        return s.fixed_s + 100 * s.prefill_s_per_token

    stalled = at_100(speeds)
    assert stalled > 2 * at_100(ServedSpeeds(engine))
    assert at_100(speeds.rested(clock + 0.2)) == pytest.approx(stalled)  # a moment later: the same line
    assert speeds.rested(clock + 3 * SERVED_TAU_S).line() == engine.line()  # idle: the engine's own fit
    assert speeds.rested(clock - 1.0) == speeds  # a clock before the last point ages nothing


def crowded_points(rng: random.Random, count: int) -> list[tuple[int, float, int]]:
    """``(tokens waited, seconds, requests in flight)`` of an engine taking 10 ms, 20 us a token and 30 ms per request
    in flight to a first token; busier moments have more tokens waiting."""
    points = []
    for _ in range(count):
        n = rng.randrange(7)
        tokens = rng.randrange(64, 2000) + 300 * n
        points.append((tokens, 0.01 + 2e-5 * tokens + 0.03 * n, n))
    return points


def test_the_cost_of_each_request_in_flight_is_fitted_beside_the_rate() -> None:
    # Served first tokens of an engine whose running requests each add 30 ms to a new one's first token:
    # 10 ms fixed, 20 us a token waited for, 0 to 6 other requests in flight. The fit tells the three apart,
    # although busier moments also had more tokens waiting.
    seed = 20261206
    rng = random.Random(seed)
    engine = run([(32, 0.01 + 32 * 2e-5), (512, 0.01 + 512 * 2e-5)])
    speeds = ServedSpeeds(engine)
    for tokens, seconds, n in crowded_points(rng, 40):
        speeds = ServedSpeeds(engine, speeds.served.point(tokens, seconds, n))
    assert speeds.terms() == pytest.approx((0.01, 2e-5, 0.03), rel=1e-3), f"seed {seed}"
    # The worker's own points, bounded as they come (the first ones against the engine's fit, which prices no
    # request in flight): the cost still shows within a few dozen.
    bounded = ServedSpeeds(engine)
    for tokens, seconds, n in crowded_points(rng, 40):
        bounded = bounded.with_served(tokens, seconds, 0.0, n)
    assert bounded.per_request_s == pytest.approx(0.03, rel=0.1), f"seed {seed}"
    # With no spread in requests in flight, nothing is priced per request.
    alone = ServedSpeeds(engine)
    for tokens in (900, 100, 1700, 400, 1200):
        alone = ServedSpeeds(engine, alone.served.point(tokens, 0.05 + 2e-5 * tokens, 2))
    assert alone.per_request_s == 0.0 and alone.line() == pytest.approx((0.05, 2e-5))


def test_alike_short_prompts_still_price_the_requests_in_flight_at_the_engines_rate() -> None:
    # Tiny prompts (too alike to fit a rate): the engine's 15 us a token stands, and what is left is 12 ms
    # fixed plus 40 ms per request in flight.
    seed = 61206
    rng = random.Random(seed)
    engine = run([(32, 0.01 + 32 * 15e-6), (512, 0.01 + 512 * 15e-6)])
    speeds = ServedSpeeds(engine)
    for _ in range(20):
        n, tokens = rng.randrange(5), rng.randrange(20, 60)
        speeds = ServedSpeeds(engine, speeds.served.point(tokens, 0.012 + 15e-6 * tokens + 0.04 * n, n))
    assert speeds.terms() == pytest.approx((0.012, 15e-6, 0.04), rel=1e-3), f"seed {seed}"


def test_requests_in_flight_that_do_not_slow_the_first_token_cost_nothing() -> None:
    # Noise that falls with the requests in flight (a negative slope) is not a negative price.
    engine = run([(32, 0.01 + 32 * 2e-5), (512, 0.01 + 512 * 2e-5)])
    speeds = ServedSpeeds(engine)
    for k in range(12):
        n, tokens = k % 4, (600, 1800, 300)[k % 3]
        speeds = speeds.with_served(tokens, 0.05 + 2e-5 * tokens - 0.005 * n, 0.0, n)
    assert speeds.per_request_s == 0.0
    assert speeds.fixed_s > 0.03
