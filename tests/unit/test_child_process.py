"""``launch.child.ChildProcess``: lines kept and matched after a mark, clear failures, stop and kill."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from kvrelay.launch.child import ChildProcess, ChildTimeout

PRINTER = "import sys, time\nfor line in sys.argv[1:]:\n    print(line, flush=True)\ntime.sleep(60)\n"


def printer(name: str, *lines: str, **kw: object) -> ChildProcess:
    return ChildProcess(name, [sys.executable, "-c", PRINTER, *lines], os.environ, **kw)  # type: ignore[arg-type]


def test_lines_are_matched_after_a_mark() -> None:
    child = printer("p", "ready port=1", "ready port=2")
    try:
        assert child.wait_for(r"port=(\d)", 30).group(1) == "1"
        child.wait_for("port=2", 30)
        assert child.wait_for(r"port=(\d)", 30, after=1).group(1) == "2"
        with pytest.raises(
            ChildTimeout, match=r"(?s)p: no line matching '[^']*' within 0.2 s \(exit code None\).*ready port=2"
        ):
            child.wait_for(r"port=\d", 0.2, after=child.mark())
    finally:
        assert child.stop(10) == -signal.SIGTERM


def test_a_child_that_exits_fails_the_wait_at_once() -> None:
    child = ChildProcess("gone", [sys.executable, "-c", "print('bye')"], os.environ)
    with pytest.raises(ChildTimeout, match=r"(?s)gone: .*exit code 0.*bye"):
        child.wait_for("never", 60)
    assert child.stop() == 0


def test_stderr_goes_to_a_file_when_given_one(tmp_path: Path) -> None:
    log = (tmp_path / "log").open("w")
    code = "import sys; print('out', flush=True); print('err', file=sys.stderr, flush=True)"
    child = ChildProcess("two", [sys.executable, "-c", code], os.environ, stderr=log)
    assert child.process.wait(30) == 0 and child.stop() == 0
    log.close()
    assert child.lines == ["out"] and (tmp_path / "log").read_text() == "err\n"


def test_stop_kills_a_child_that_ignores_the_signal() -> None:
    code = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('on', flush=True)\ntime.sleep(60)"
    child = ChildProcess("stubborn", [sys.executable, "-c", code], os.environ)
    child.wait_for("on", 30)
    assert child.stop(0.5) == -signal.SIGKILL
