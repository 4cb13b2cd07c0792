"""Prompt tokens the engines served from cache, read from their own Prometheus ``/metrics``.

``cached_prompt_tokens(text)`` sums, in one ``/metrics`` text: vLLM's ``vllm:prefix_cache_hits`` counter
(prompt tokens found in its prefix cache) and kvrelay's ``kvrelay_cached_tokens`` counter (prompt tokens served
from any cache tier, as its workers reported them), over all label sets. ``scrape(urls)`` is that sum over
every URL's ``/metrics`` (a URL that does not answer counts 0, so a stopped face reads as nothing). A replay's
figure is the difference of two scrapes around it, so warm-up and readiness probes are not counted.
"""

from __future__ import annotations

from collections.abc import Sequence

import httpx
from prometheus_client.parser import text_string_to_metric_families

CACHED_SAMPLES = frozenset({"vllm:prefix_cache_hits_total", "kvrelay_cached_tokens_total"})


def cached_prompt_tokens(text: str) -> float:
    """The prompt tokens served from cache in one ``/metrics`` text (see the module contract)."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        total += sum(s.value for s in family.samples if s.name in CACHED_SAMPLES)
    return total


def scrape(urls: Sequence[str], timeout_s: float = 10.0) -> float:
    """``cached_prompt_tokens`` summed over every URL's ``/metrics``."""
    total = 0.0
    with httpx.Client(timeout=timeout_s) as client:
        for url in urls:
            try:
                answer = client.get(url + "/metrics")
            except httpx.HTTPError:
                continue
            if answer.status_code == 200:
                total += cached_prompt_tokens(answer.text)
    return total
