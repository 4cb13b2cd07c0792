"""Routing policies by name: kvrelay's own, the baselines, and the peers' (issue 3)."""

from __future__ import annotations

from collections.abc import Callable

from kvrelay.core.policies.base import Policy
from kvrelay.core.policies.baselines import LeastLoaded, RoundRobin
from kvrelay.core.policies.dynamo_kv import DynamoKV
from kvrelay.core.policies.kvrelay_ttft import PredictedTTFT
from kvrelay.core.policies.llmd_affinity import LlmdAffinity
from kvrelay.core.policies.llmd_scorer import LlmdScorer
from kvrelay.core.policies.mooncake_conductor import MooncakeConductor
from kvrelay.core.policies.sglang_cache_aware import SGLangCacheAware
from kvrelay.core.policies.smg_cache_aware import SmgCacheAware, SmgKvEvents

DEFAULT_POLICY = PredictedTTFT.name
"""The policy a router runs unless told otherwise: kvrelay's own."""

POLICIES: dict[str, Callable[[], Policy]] = {
    DEFAULT_POLICY: PredictedTTFT,
    "round_robin": RoundRobin,
    "least_loaded": LeastLoaded,
    "smg_cache_aware": SmgCacheAware,
    "smg_kv_events": SmgKvEvents,
    "sglang_cache_aware": SGLangCacheAware,
    "dynamo": DynamoKV,
    "llm_d": LlmdAffinity,
    "llm_d_scorers": LlmdScorer,
    "mooncake": MooncakeConductor,
}
POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)


def make_policy(name: str) -> Policy:
    """A fresh policy instance; raises ValueError naming the known policies."""
    factory = POLICIES.get(name)
    if factory is None:
        raise ValueError(f"policy '{name}' is unknown; known policies: {', '.join(POLICY_NAMES)}")
    return factory()
