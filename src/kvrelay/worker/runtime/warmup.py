"""Measure a runtime's speeds before it serves, so its first heartbeats report what a forward costs here.

A cold worker reported the 1 ms/token prior until its first prompts had been
written: the router planned a cold Gemma 3 270M worker's first 951-token prefill,
on a shared core, at 1.1 s against 2.0 s measured. ``measure_speeds`` runs, on
the highest pages of the pool (nobody holds pages before the worker serves; the
K/V it writes there is never registered, so those pages stay free):

1. a full-budget prompt, to warm the kernels and the allocator (not counted);
2. ``STEP_SAMPLES`` one-token prompts, each one forward: the fixed cost of a
   forward (``step_s``) is the least of them;
3. a full-budget prompt: the prefill seconds per token, less that step.

The runtime learns from every forward (``core.worker.speeds``); this replaces
its prior with those measurements. The least of several, because a stall only
ever adds time, and one sample was the first one-token forward the process ever
ran, on a machine where every worker of a cluster warms up at once: two Gemma 3
270M workers measured 0.071 and 0.135 s against the 0.035 to 0.04 s their
forwards then took, and a worker that warmed up slow kept its figure (its best,
``rested`` relaxes toward) and got almost no request (docs/performance.md,
"Warm-up step samples").
"""

from __future__ import annotations

from kvrelay.core.worker.speeds import MIN_PREFILL_SAMPLE, DeviceSpeeds
from kvrelay.worker.runtime.jobs import Job
from kvrelay.worker.runtime.loop import PagedRuntime

STEP_SAMPLES = 4
"""One-token forwards timed at start-up; the step is the least of them."""


def measure_speeds(runtime: PagedRuntime, vocab_size: int, max_tokens: int, timeout_s: float = 120.0) -> DeviceSpeeds:
    """Run the jobs of the module docstring and return the speeds they measured (the runtime's from then on).

    The prompts take the token budget, at most ``max_tokens`` (the context limit); skipped (the runtime's speeds
    are returned as they are) when that is too short to teach the prefill speed or the pool cannot hold it.
    Call before the worker takes requests."""
    kv = runtime.kv
    budget = min(runtime.policy.token_budget, max_tokens)
    pages = -(-budget // kv.page_tokens)
    if budget < MIN_PREFILL_SAMPLE or pages > kv.num_pages or vocab_size < 2:
        return runtime.speeds
    table = tuple(range(kv.num_pages - pages, kv.num_pages))
    prompt = tuple(1 + i % (vocab_size - 1) for i in range(budget))
    runtime.generate(Job(prompt, table, 0, 1), timeout_s)
    steps = []
    for _ in range(STEP_SAMPLES):
        runtime.speeds = DeviceSpeeds()  # between jobs: the device thread is idle
        runtime.generate(Job(prompt[:1], table, 0, 1), timeout_s)
        steps.append(runtime.speeds.step_s)
    step = min(steps)
    runtime.speeds = DeviceSpeeds(step_s=step, step_measured=True, best_step_s=step)
    runtime.generate(Job(prompt, table, 0, 1), timeout_s)
    return runtime.speeds
