"""Routing policies by name: kvrelay's own, the baselines, and the peers' (issue 3)."""

from __future__ import annotations

from collections.abc import Callable

from kvrelay.controller.policies.baselines import LeastLoaded, RoundRobin
from kvrelay.controller.policies.dynamo_kv import DynamoKV
from kvrelay.controller.policies.kvrelay_ttft import PredictedTTFT
from kvrelay.controller.policies.llmd_scorer import LlmdScorer
from kvrelay.controller.policies.mooncake_conductor import MooncakeConductor
from kvrelay.controller.policies.sglang_cache_aware import SGLangCacheAware
from kvrelay.controller.policy import Policy

POLICIES: dict[str, Callable[[], Policy]] = {
    "kvrelay": PredictedTTFT,
    "round_robin": RoundRobin,
    "least_loaded": LeastLoaded,
    "sglang_cache_aware": SGLangCacheAware,
    "dynamo": DynamoKV,
    "llm_d": LlmdScorer,
    "mooncake": MooncakeConductor,
}
POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)


def make_policy(name: str) -> Policy:
    """A fresh policy instance; raises ValueError naming the known policies."""
    factory = POLICIES.get(name)
    if factory is None:
        raise ValueError(f"policy '{name}' is unknown; known policies: {', '.join(POLICY_NAMES)}")
    return factory()
