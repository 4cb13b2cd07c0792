"""A fixed background load for benchmarks: a process that keeps a share of one CPU core busy.

``cpu_hog(share, cpu)`` runs ``python -m kvrelay.bench.background_load --share S --cpu C`` for the body of a
``with``: a child pinned to core ``cpu`` (``sched_setaffinity``) that spins for ``share`` of every
``PERIOD_S`` and sleeps the rest, so the machine loses about ``share`` of a core to it whatever else runs,
the same in every replay. It is killed when the block ends, also on error.

``autogroups_off()`` turns Linux's session autogroups off for the body of a ``with`` where this process may
(root), so that such a load takes the same share from every setup. With them on (the default of many
distributions) the scheduler shares a core between sessions first and between a session's threads second, and
the hog, busy for a share of wall-clock time, then takes more of its core from a setup whose processes share one
session (``kvrelay cluster``: its router and workers; an engine's API server and engine core) than from one
whose engines each have their own (the peers' servers): 0.43 against 0.35 of core 0, two 2-thread processes of
matrix products beside a 0.5 hog, one session against two; 0.32-0.33 either way with autogroups off.
"""

from __future__ import annotations

import argparse
import enum
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PERIOD_S = 0.02
"""One busy-then-idle cycle: short against a request's TTFT, so every replay sees the same average load."""


def spin(share: float, period_s: float = PERIOD_S) -> None:
    """Busy for ``share`` of each period, asleep the rest, forever."""
    busy = share * period_s
    while True:
        start = time.perf_counter()
        while time.perf_counter() - start < busy:
            pass
        time.sleep(max(0.0, period_s - (time.perf_counter() - start)))


@contextmanager
def cpu_hog(share: float, cpu: int = 0) -> Iterator[subprocess.Popen[bytes]]:
    """The hog child for the body of the block (see the module contract)."""
    if not 0.0 < share <= 1.0:
        raise ValueError(f"share {share} is not in (0, 1]: it is the share of one core the load takes")
    argv = [sys.executable, "-m", "kvrelay.bench.background_load", "--share", str(share), "--cpu", str(cpu)]
    child = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    try:
        yield child
    finally:
        child.kill()
        child.wait()


AUTOGROUP_SWITCH = Path("/proc/sys/kernel/sched_autogroup_enabled")


class Autogroups(enum.Enum):
    """The scheduler's session autogroups during ``autogroups_off``'s block."""

    ABSENT = "absent (this kernel has none)"
    OFF = "off"
    TURNED_OFF = "turned off for the run"
    ON = "on: the load's share depends on how each setup's processes share sessions (run as root to turn them off)"


@contextmanager
def autogroups_off(switch: Path = AUTOGROUP_SWITCH) -> Iterator[Autogroups]:
    """Autogroups off for the block where ``switch`` can be written, restored after, also on error (see the
    module contract); yields what they are during the block."""
    try:
        before = switch.read_text().strip()
    except OSError:
        yield Autogroups.ABSENT
        return
    if before == "0":
        yield Autogroups.OFF
        return
    try:
        switch.write_text("0\n")
    except OSError:
        yield Autogroups.ON
        return
    try:
        yield Autogroups.TURNED_OFF
    finally:
        switch.write_text(before + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--share", type=float, required=True, help="share of one core kept busy, in (0, 1]")
    parser.add_argument("--cpu", type=int, default=0, help="the core to pin to")
    args = parser.parse_args(argv)
    os.sched_setaffinity(0, {args.cpu})
    spin(args.share)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
