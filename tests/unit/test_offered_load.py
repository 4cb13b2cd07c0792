"""The offered load (``core.router.offered_load``): an exponentially weighted arrival rate of prefill work."""

from __future__ import annotations

import math

import pytest

from kvrelay.core.router.offered_load import (
    LONG_BACKLOG_S,
    OVERLOAD_RATIO,
    WINDOW_S,
    OfferedLoad,
    capacity,
    long_backlog,
)


def test_each_arrival_adds_its_work_over_the_window_and_the_rate_decays_between() -> None:
    load = OfferedLoad().arrived(10.0, 2.0)
    assert load.rate_at(10.0) == pytest.approx(2.0 / WINDOW_S)
    assert load.rate_at(10.0 + WINDOW_S) == pytest.approx(2.0 / WINDOW_S / math.e)
    load = load.arrived(10.0 + WINDOW_S, 3.0)
    assert load.rate_at(10.0 + WINDOW_S) == pytest.approx((2.0 / math.e + 3.0) / WINDOW_S)


def test_a_steady_stream_converges_to_its_work_per_second() -> None:
    load = OfferedLoad()
    for i in range(2000):  # 0.5 s of work every 0.1 s: 5 s of work per second
        load = load.arrived(i * 0.1, 0.5)
    assert load.rate_at(199.9) == pytest.approx(5.0, rel=0.02)
    assert load.ratio(199.9, capacity([1e-4, 1e-4])) == pytest.approx(2.5, rel=0.02)


def test_an_arrival_stamped_before_the_last_does_not_grow_the_rate_by_decaying_backwards() -> None:
    load = OfferedLoad().arrived(5.0, 1.0).arrived(4.0, 1.0)
    assert load.rate_at(5.0) == pytest.approx(2.0 / WINDOW_S)
    assert load.at == 5.0


def test_capacity_counts_each_worker_at_its_speed_relative_to_the_fastest() -> None:
    assert capacity([1e-4, 1e-4, 2.5e-4, 2.5e-4]) == pytest.approx(2.8)
    assert capacity([0.0, 1e-4]) == pytest.approx(2.0), "a worker with no measured rate counts as one"
    assert capacity([]) == 0.0
    assert OfferedLoad().arrived(0.0, 1.0).ratio(0.0, 0.0) == 0.0, "no capacity: no ratio"


def test_a_long_backlog_is_served_by_its_own_keys_only_while_the_cluster_is_not_overloaded() -> None:
    rates = [1e-4, 1e-4]  # capacity 2 s of work per second
    quiet = OfferedLoad().arrived(0.0, 1.0)
    assert not long_backlog(quiet, 0.0, 2 * LONG_BACKLOG_S, rates), "at the bound the backlog is not long yet"
    assert long_backlog(quiet, 0.0, 2 * LONG_BACKLOG_S + 1.0, rates)
    flood = OfferedLoad().arrived(0.0, OVERLOAD_RATIO * 2 * WINDOW_S)  # twice the capacity, over the window
    assert not long_backlog(flood, 0.0, 100.0, rates), "under overload, the usual keys"
    assert long_backlog(flood, 1.0, 100.0, rates), "the rate decays once the flood stops"
    assert not long_backlog(quiet, 0.0, 100.0, []), "no workers, no long backlog"
