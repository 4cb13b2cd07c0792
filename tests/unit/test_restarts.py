"""``kvrelay cluster``'s restart rule: crashes are restarted with growing delays, clean stops and crash loops
are not, and every exit status is named in words."""

from __future__ import annotations

import signal

from kvrelay.launch.restarts import RestartPolicy, Verdict, decide, describe_exit

POLICY = RestartPolicy(max_restarts=3, window_s=60.0, first_delay_s=0.5, max_delay_s=1.5)


def test_a_crash_is_restarted_with_a_delay_that_grows_within_the_window() -> None:
    assert decide(-9, [], 100.0, POLICY) == decide(1, [], 100.0, POLICY)
    delays = [decide(-9, [90.0] * n, 100.0, POLICY).delay_s for n in range(3)]
    assert delays == [0.5, 1.0, 1.5]  # capped at max_delay_s
    assert all(decide(-9, [90.0] * n, 100.0, POLICY).verdict is Verdict.RESTART for n in range(3))


def test_a_crash_loop_stops_being_restarted_and_old_restarts_are_forgotten() -> None:
    loop = decide(-11, [95.0, 97.0, 99.0], 100.0, POLICY)
    assert loop.verdict is Verdict.TOO_MANY and loop.recent == 3
    assert decide(-11, [10.0, 20.0, 30.0], 100.0, POLICY).verdict is Verdict.RESTART  # outside the window


def test_a_clean_exit_is_a_deliberate_stop() -> None:
    assert decide(0, [], 1.0, POLICY).verdict is Verdict.CLEAN_EXIT


def test_exit_statuses_are_named() -> None:
    assert describe_exit(-signal.SIGKILL) == "signal SIGKILL"
    assert describe_exit(2) == "code 2" and describe_exit(0) == "code 0"
    assert describe_exit(-200) == "signal 200"
