"""The prefill queue order: started prefills first, then waiting ones by priority, ties in arrival order."""

from __future__ import annotations

import pytest

from kvrelay.core.planning.prefill_order import queue_position


def test_equal_priorities_queue_in_arrival_order() -> None:
    assert queue_position([0.0, 0.0, 0.0], started=1, priority=0.0) == 3
    assert queue_position([], started=0, priority=7.0) == 0


def test_a_newcomer_passes_only_waiting_prefills_of_higher_value() -> None:
    # started: 9.0; waiting: 1.0, 2.0, 2.0, 5.0
    priorities = [9.0, 1.0, 2.0, 2.0, 5.0]
    assert queue_position(priorities, started=1, priority=2.0) == 4  # behind both 2.0s (arrival order)
    assert queue_position(priorities, started=1, priority=1.5) == 2
    assert queue_position(priorities, started=1, priority=6.0) == 5


def test_a_started_prefill_is_never_passed() -> None:
    assert queue_position([9.0, 8.0], started=2, priority=-1.0) == 2
    assert queue_position([9.0, 1.0], started=1, priority=-1.0) == 1


def test_started_must_lie_within_the_queue() -> None:
    with pytest.raises(ValueError, match="started must be within 0..1, got 2"):
        queue_position([1.0], started=2, priority=0.0)
