"""Routing policies by name: kvrelay's own, the baselines, and the peers' (issue 3)."""

from __future__ import annotations

from collections.abc import Callable

from kvrelay.controller.policies.baselines import LeastLoaded, RoundRobin
from kvrelay.controller.policies.kvrelay_ttft import PredictedTTFT
from kvrelay.controller.policy import Policy

POLICIES: dict[str, Callable[[], Policy]] = {
    "kvrelay": PredictedTTFT,
    "round_robin": RoundRobin,
    "least_loaded": LeastLoaded,
}
POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)


def make_policy(name: str) -> Policy:
    """A fresh policy instance; raises ValueError naming the known policies."""
    factory = POLICIES.get(name)
    if factory is None:
        raise ValueError(f"policy '{name}' is unknown; known policies: {', '.join(POLICY_NAMES)}")
    return factory()
