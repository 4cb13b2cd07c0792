"""The bench's load switches: session autogroups off for a block where the switch can be written, restored after."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvrelay.bench.background_load import Autogroups, autogroups_off, cpu_hog


def test_autogroups_are_off_inside_the_block_and_restored_after_it_also_on_error(tmp_path: Path) -> None:
    switch = tmp_path / "sched_autogroup_enabled"
    switch.write_text("1\n")
    with autogroups_off(switch) as state:
        assert state is Autogroups.TURNED_OFF and switch.read_text() == "0\n"
    assert switch.read_text() == "1\n"
    with pytest.raises(RuntimeError), autogroups_off(switch):
        assert switch.read_text() == "0\n"
        raise RuntimeError("a replay failed")
    assert switch.read_text() == "1\n"


def test_a_switch_already_off_missing_or_not_writable_is_left_as_it_is(tmp_path: Path) -> None:
    switch = tmp_path / "sched_autogroup_enabled"
    switch.write_text("0\n")
    with autogroups_off(switch) as state:
        assert state is Autogroups.OFF
    assert switch.read_text() == "0\n"
    with autogroups_off(tmp_path / "missing") as state:
        assert state is Autogroups.ABSENT
    stat = Path("/proc/self/stat")  # readable, not "0", and not writable even by root
    before = stat.read_text().split()[0]
    with autogroups_off(stat) as state:
        assert state is Autogroups.ON
    assert stat.read_text().split()[0] == before


def test_a_hog_share_outside_one_core_is_refused() -> None:
    for share in (0.0, 1.5):
        with pytest.raises(ValueError, match="share of one core"), cpu_hog(share):
            pass
