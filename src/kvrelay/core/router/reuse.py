"""Decision quality: the prefix reuse there was, what the routing captured of it, what the workers delivered.

Three cumulative figures in tokens, counted by the pure router in ``RouterState.counters``:

- available (``attempts.route``, per attempt routed): the longest leading part of the attempt's chain the
  residency index holds anywhere (any tier of any live worker, a chunk a routed request is computing there,
  or the object tier), i.e. what an ideal route could reuse;
- captured (same place): the cached tokens of the chosen candidate's route;
- delivered (``assignment_messages._on_result``, per result of a current attempt): the cached tokens, all
  tiers, that the worker's usage reports it restored or found.

``captured <= available`` always: a route walks only chunks the index holds. ``delivered`` sums exactly what
the outcomes' ``usage.cached_tokens`` sum; it falls short of ``captured`` when an offer is declined or a
worker lost what the router thought it held, and may pass it when the worker held more than the router knew.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

AVAILABLE = "reuse_available_tokens"
CAPTURED = "reuse_captured_tokens"
DELIVERED = "reuse_delivered_tokens"


@dataclass(frozen=True, slots=True)
class ReuseFigures:
    """The three cumulative figures (see the module docstring) and their shares of what was available."""

    available_tokens: int = 0
    captured_tokens: int = 0
    delivered_tokens: int = 0

    @property
    def captured_share(self) -> float:
        """Captured over available (0 when nothing was available)."""
        return self.captured_tokens / self.available_tokens if self.available_tokens else 0.0

    @property
    def delivered_share(self) -> float:
        """Delivered over available (0 when nothing was available)."""
        return self.delivered_tokens / self.available_tokens if self.available_tokens else 0.0

    def as_dict(self) -> dict[str, int]:
        """The JSON shape of ``/cluster``'s ``reuse`` key."""
        return {
            "available_tokens": self.available_tokens,
            "captured_tokens": self.captured_tokens,
            "delivered_tokens": self.delivered_tokens,
        }


def reuse_figures(counters: Mapping[str, int]) -> ReuseFigures:
    """The figures a router's counters hold so far."""
    return ReuseFigures(counters.get(AVAILABLE, 0), counters.get(CAPTURED, 0), counters.get(DELIVERED, 0))
