"""Measure a runtime's speeds before it serves, so its first heartbeats report what a forward costs here.

A cold worker reported the 1 ms/token prior until its first prompts had been
written: the router planned a cold Gemma 3 270M worker's first 951-token prefill,
on a shared core, at 1.1 s against 2.0 s measured. ``measure_speeds`` runs, on
the highest pages of the pool (nobody holds pages before the worker serves; the
K/V it writes there is never registered, so those pages stay free):

1. a full-budget prompt, to warm the kernels and the allocator (not counted);
2. a one-token prompt: one forward, the fixed cost of a forward (``step_s``);
3. a full-budget prompt: the prefill seconds per token, less that step.

The runtime learns from every forward (``core.worker.speeds``); this replaces
its prior with the last two measurements.
"""

from __future__ import annotations

from kvrelay.core.worker.speeds import MIN_PREFILL_SAMPLE, DeviceSpeeds
from kvrelay.worker.runtime.jobs import Job
from kvrelay.worker.runtime.loop import PagedRuntime


def measure_speeds(runtime: PagedRuntime, vocab_size: int, max_tokens: int, timeout_s: float = 120.0) -> DeviceSpeeds:
    """Run the three jobs of the module docstring and return the speeds the runtime learned from the last two.

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
    runtime.speeds = DeviceSpeeds()  # between jobs: the device thread is idle
    runtime.generate(Job(prompt[:1], table, 0, 1), timeout_s)
    runtime.generate(Job(prompt, table, 0, 1), timeout_s)
    return runtime.speeds
