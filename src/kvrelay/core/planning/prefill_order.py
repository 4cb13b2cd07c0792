"""Where a new prefill joins a worker's queue, by the offer's priority (``Offer.priority``).

The queue is the started prefills (in the order they started) followed by the
waiting ones in ascending priority, ties in arrival order. A newcomer never
passes a started prefill (chunked prefill is not preempted), and passes every
waiting prefill of strictly higher priority value. With every priority equal
the queue is FIFO. The convention is vLLM's ``--scheduling-policy priority``
(lower value first, arrival order breaks ties); unlike vLLM, nothing running is
preempted.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from typing import TypeVar

Key = TypeVar("Key", float, tuple[float, float])
"""A priority, or ``(priority, place)`` where a later tie-break than arrival is wanted (the live runtime's)."""


def queue_position(priorities: Sequence[Key], started: int, priority: Key) -> int:
    """The index at which a prefill of ``priority`` is inserted into a queue.

    Before: ``priorities`` are the queue's priorities (or keys) in queue order, its first
    ``started`` entries the started prefills, the rest ascending.
    After: inserting there keeps the rest ascending and stable; the result is
    at least ``started``.
    """
    if not 0 <= started <= len(priorities):
        raise ValueError(f"started must be within 0..{len(priorities)}, got {started}")
    return bisect_right(priorities, priority, lo=started)
