"""The device speeds a worker learns from its own forwards, and the waits they predict. Pure.

The paged runtime runs one forward per iteration (``worker.runtime.iteration``):
the decoding lanes' one-token rows first, then prompt chunks, at most
``token_budget`` rows. To first order a forward costs

    seconds = step_s + prefill_tokens * prefill_s_per_token

``step_s`` is what a forward costs whatever it prefills: the weights streamed
once, the decode rows (their LM-head rows above all), batch building and
sampling. The Gemma 3 270M calibration (``configs/calibration-gemma3-270m-cpu.toml``:
77 ms at 1 lane to 106 ms at 16, 81 ms for a forward that only prefills) shows
it moves little with the lanes, so one figure is learned, as the simulator's
``CalibratedWorkerSpec.iteration_s`` models it.

``learn`` folds in one forward: one with at least ``MIN_PREFILL_SAMPLE`` prompt
tokens teaches ``prefill_s_per_token`` (its time less ``step_s``, per token), a
smaller one teaches ``step_s`` (its time less its prompt tokens' share). The
first sample of each replaces the prior; each later one moves the estimate by
``1 - exp(-seconds / TAU_S)``: a time-weighted average over the last few seconds
of device time. A sample counts as at most ``OUTLIER_FACTOR`` times the time the
measured speeds predict for its forward (never less than ``OUTLIER_FLOOR_S``):
one stall (a stopped process, a swap storm) moves the estimate a bounded step,
where unbounded a 4-s stall made an idle worker look 50 times slower than it
is, and an idle worker never corrects it (the lab's frozen worker got no
request after its thaw); a lasting slowdown still shows within a few forwards,
each moving the bound up. A worker measures both at start (``worker.runtime.warmup``),
before it serves. The seconds are wall time, so they count the time the device thread waited for a core: the speeds are
what the worker gets now, on a shared machine too. (Learned per finished job
before, from a 1 ms/token prior: on cold Gemma workers sharing 2 cores the
router planned a 951-token prefill at 0.95 s that took 5.7 s, and the first
results came back only after the whole 24-request burst had been routed.)

A worker re-measures only when it runs, so speeds learned on a loaded moment
(three workers calibrating on two cores, a fault) would stay with a worker the
router then never picks: in the lab, two idle workers reported 100 times their
peer's prefill cost and got no request in six waves. So after ``REST_AFTER_S``
without a forward the estimate relaxes (``rested``) toward the best one the
worker has learned, by ``1 - exp(-(idle - REST_AFTER_S) / REST_TAU_S)``; the
heartbeat reports that, and the next forward learns from it. A worker that is
slow for good is picked again now and then, and its first forwards teach it the
slow figure once more.

What the heartbeat reports from them (``heartbeat_speeds``):

- ``queue_delay_s``: ``drain_s``, the seconds until the queued prompt tokens are
  written: ``ceil(tokens / (budget - decoding))`` forwards, each ``step_s`` plus
  its tokens (the decoding lanes take their rows of every forward first), where
  ``budget`` is what a forward may take now (the prefill-only budget while no
  lane decodes, ``worker.runtime.iteration.PolicyConfig.budget``);
- ``prefill_s_per_token``: the same per added prompt token, ``step_s`` spread
  over the prompt tokens a forward of the token budget holds beside the decoding
  lanes. Not over the prefill-only budget: a prompt shorter than that forward
  still pays the whole step, and the router charges per token, so spreading the
  step over 2,048 tokens made an idle worker's 512-token recompute look a
  quarter-step cheaper than it is (a fault test's router then recomputed a
  resident prompt on the other worker);
- ``decode_s_per_token``: one forward, ``step_s``: what a decoding lane waits per
  token, and what the router adds for the forward that samples the first token.
"""

from __future__ import annotations

import math
from typing import NamedTuple

TAU_S = 4.0
"""Seconds of device time over which the learned speeds average."""
MIN_PREFILL_SAMPLE = 64
"""A forward with at least this many prompt tokens teaches the prefill speed; a smaller one the step."""
OUTLIER_FACTOR = 4.0
"""A forward's sample is at most this many times the time the measured speeds predict for it."""
OUTLIER_FLOOR_S = 0.05
"""Samples up to this many seconds are never bounded: short ones move the estimate little anyway."""
MIN_PREFILL_S_PER_TOKEN = 1e-7
"""The prefill speed never learns below this (a forward quicker than the step leaves no time for its tokens)."""
REST_AFTER_S = 10.0
"""Seconds without a forward after which the estimate relaxes toward the best one learned."""
REST_TAU_S = 10.0
"""Seconds of rest over which the estimate moves ``1 - 1/e`` of the way to the best one."""


class DeviceSpeeds(NamedTuple):
    """What a forward costs on this worker now (see the module docstring); ``*_measured``: False while the
    figure is still the prior."""

    prefill_s_per_token: float = 1e-3
    step_s: float = 0.05
    prefill_measured: bool = False
    step_measured: bool = False
    best_prefill_s_per_token: float = math.inf
    """The lowest measured ``prefill_s_per_token`` (``inf``: none yet)."""
    best_step_s: float = math.inf
    """The lowest measured ``step_s`` (``inf``: none yet)."""
    learned_at: float = -math.inf
    """The monotonic second of the last forward learned."""


class HeartbeatSpeeds(NamedTuple):
    """The speed and queue figures of a heartbeat (see the module docstring)."""

    queue_delay_s: float
    prefill_s_per_token: float
    decode_s_per_token: float


def bounded_sample(seconds: float, predicted: float) -> float:
    """``seconds`` counted as at most ``OUTLIER_FACTOR`` times ``predicted`` (never bounded below
    ``OUTLIER_FLOOR_S``): what one stalled sample may teach (see the module docstring)."""
    return min(seconds, max(OUTLIER_FACTOR * predicted, OUTLIER_FLOOR_S))


def _moved(old: float, sample: float, seconds: float, measured: bool) -> float:
    if not measured:
        return sample
    weight = 1.0 - math.exp(-seconds / TAU_S)
    return old + weight * (sample - old)


def rested(speeds: DeviceSpeeds, now: float) -> DeviceSpeeds:
    """``speeds`` at monotonic second ``now``: as learned until ``REST_AFTER_S`` after the last forward, then
    relaxing toward the best measured figures (see the module docstring)."""
    idle = now - speeds.learned_at
    if not REST_AFTER_S < idle < math.inf:  # also NaN: no forward learned, or no clock given
        return speeds
    weight = 1.0 - math.exp(-(idle - REST_AFTER_S) / REST_TAU_S)
    prefill, step = speeds.prefill_s_per_token, speeds.step_s
    if speeds.best_prefill_s_per_token < prefill:
        prefill += weight * (speeds.best_prefill_s_per_token - prefill)
    if speeds.best_step_s < step:
        step += weight * (speeds.best_step_s - step)
    return speeds._replace(prefill_s_per_token=prefill, step_s=step)


def learn(speeds: DeviceSpeeds, prefill_tokens: int, seconds: float, now: float = -math.inf) -> DeviceSpeeds:
    """The speeds after one forward, ended at monotonic second ``now``, that wrote ``prefill_tokens`` prompt
    tokens (and any decode rows) in ``seconds``, counted as at most ``OUTLIER_FACTOR`` times its predicted time;
    learned from the ``rested`` estimate. A forward of no time teaches nothing."""
    if seconds <= 0.0:
        return speeds
    speeds = rested(speeds, now)._replace(learned_at=now)
    prefill = prefill_tokens >= MIN_PREFILL_SAMPLE
    if speeds.step_measured and (speeds.prefill_measured or not prefill):
        predicted = speeds.step_s + prefill_tokens * speeds.prefill_s_per_token
        seconds = bounded_sample(seconds, predicted)
    if prefill:
        per_token = max(MIN_PREFILL_S_PER_TOKEN, (seconds - speeds.step_s) / prefill_tokens)
        learned = _moved(speeds.prefill_s_per_token, per_token, seconds, speeds.prefill_measured)
        best = min(speeds.best_prefill_s_per_token, learned)
        return speeds._replace(prefill_s_per_token=learned, prefill_measured=True, best_prefill_s_per_token=best)
    step = _moved(
        speeds.step_s, max(0.0, seconds - prefill_tokens * speeds.prefill_s_per_token), seconds, speeds.step_measured
    )
    return speeds._replace(step_s=step, step_measured=True, best_step_s=min(speeds.best_step_s, step))


def prompt_room(decoding: int, budget: int) -> int:
    """Prompt tokens a forward holds beside ``decoding`` decoding lanes (they keep one for prefill)."""
    return max(1, budget - min(decoding, budget - 1))


def drain_s(speeds: DeviceSpeeds, prefill_tokens: int, decoding: int, budget: int) -> float:
    """Seconds until ``prefill_tokens`` queued prompt tokens are written, with ``decoding`` lanes decoding
    beside them under a ``budget``-token forward; 0 with nothing queued."""
    if prefill_tokens <= 0:
        return 0.0
    forwards = -(-prefill_tokens // prompt_room(decoding, budget))
    return forwards * speeds.step_s + prefill_tokens * speeds.prefill_s_per_token


def heartbeat_speeds(
    speeds: DeviceSpeeds, queued_tokens: int, decoding: int, budget: int, drain_budget: int | None = None
) -> HeartbeatSpeeds:
    """The heartbeat's queue delay (forwards of ``drain_budget`` tokens, default ``budget``), prefill seconds per
    token (the step spread over a ``budget``-token forward) and decode seconds per token (see the module
    docstring)."""
    per_token = speeds.prefill_s_per_token + speeds.step_s / prompt_room(decoding, budget)
    queue = drain_s(speeds, queued_tokens, decoding, budget if drain_budget is None else drain_budget)
    return HeartbeatSpeeds(queue, per_token, speeds.step_s)
