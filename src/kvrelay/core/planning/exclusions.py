"""Why planning removed a worker from a request's candidates: a typed kind plus the text records show.

Decisions branch on ``Exclusion.kind``; ``Exclusion.text`` is what a decision
record stores and ``kvrelay explain`` prints (``texts``), never parsed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

__all__ = ["CAPACITY", "FAILED_BEFORE", "Exclusion", "ExclusionKind", "context_limit", "model_not_served", "texts"]


class ExclusionKind(Enum):
    """The hard constraint that removed a worker."""

    FAILED_BEFORE = "failed_before"
    """The worker failed an earlier attempt of this request."""
    MODEL_NOT_SERVED = "model_not_served"
    CONTEXT_LIMIT = "context_limit"
    """Prompt plus generation budget exceed the worker's context limit."""
    CAPACITY = "capacity"
    """No boundary of the worker's route fits its free pages."""


@dataclass(frozen=True, slots=True)
class Exclusion:
    kind: ExclusionKind
    text: str
    """The human-readable reason, as recorded."""


FAILED_BEFORE = Exclusion(ExclusionKind.FAILED_BEFORE, "excluded after an earlier failure of this request")
CAPACITY = Exclusion(ExclusionKind.CAPACITY, "capacity")


def model_not_served(model: str) -> Exclusion:
    return Exclusion(ExclusionKind.MODEL_NOT_SERVED, f"model '{model}' not served")


def context_limit(limit: int, need: int) -> Exclusion:
    """``need`` tokens (prompt plus generation budget) exceed ``limit``."""
    return Exclusion(ExclusionKind.CONTEXT_LIMIT, f"context limit {limit} < {need}")


def texts(excluded: Mapping[str, Exclusion]) -> dict[str, str]:
    """Worker id -> reason text, the form decision records store."""
    return {worker_id: exclusion.text for worker_id, exclusion in excluded.items()}
