"""A child process whose output lines are kept and searched: the one wrapper that ``kvrelay cluster``, the
cluster bench and the tests start their routers, workers and servers with.

``ChildProcess`` starts ``argv``. A reader thread keeps every line of its stdout (and of its stderr,
which by default is merged into stdout; pass a file to log it there, or ``None`` to inherit this
process's), echoing each to this process's stdout when ``echo`` is set. ``wait_for(pattern, timeout,
after)`` returns the first matching line after mark ``after`` (``mark()``), or raises
``ChildTimeout``, with the output's tail, once the timeout passes or the child has exited and all its
output is read. ``stop`` sends a signal (and SIGCONT, in case the child is stopped), waits, and kills
the child if it outlives the timeout.

A child must not outlive a supervisor that was killed: a parent that sets ``$KVRELAY_PARENT_PID`` to its
own pid in a child's environment has the ``kvrelay`` command of that child call ``follow_parent``, which
asks Linux for SIGTERM (the child's graceful stop) when the parent dies.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from signal import SIGCONT, SIGTERM, Signals
from typing import IO

log = logging.getLogger(__name__)

PARENT_PID_ENV = "KVRELAY_PARENT_PID"
"""Set by a supervisor in its children's environment: its pid, which they must not outlive."""
_PR_SET_PDEATHSIG = 1


def follow_parent() -> None:
    """If ``$KVRELAY_PARENT_PID`` names this process's parent, get SIGTERM when the parent dies (Linux's
    ``PR_SET_PDEATHSIG``), or at once if it is already gone. The variable is removed, so processes this one
    starts do not inherit it. Without the variable, or off Linux, nothing happens."""
    expected = os.environ.pop(PARENT_PID_ENV, None)
    if not expected or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(SIGTERM), 0, 0, 0) != 0:
        log.warning("cannot ask to end with the parent process: %s", os.strerror(ctypes.get_errno()))
        return
    if os.getppid() != int(expected):  # the parent died before the request took effect
        os.kill(os.getpid(), SIGTERM)


class ChildTimeout(RuntimeError):
    """A child printed no line matching a pattern in time (or exited first); the message has its output's tail."""


class ChildProcess:
    """One child process and every line it has printed (``lines``), in order."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        stderr: int | IO[str] | None = subprocess.STDOUT,
        echo: bool = False,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.lines: list[str] = []
        self._echo = echo
        self._changed = threading.Condition()
        self.process = subprocess.Popen(
            self.argv, env=dict(env), stdout=subprocess.PIPE, stderr=stderr, text=True, bufsize=1
        )
        self._reader = threading.Thread(target=self._read, name=f"read-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if self._echo:
                sys.stdout.write(line)
                sys.stdout.flush()
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    @property
    def pid(self) -> int:
        return self.process.pid

    def mark(self) -> int:
        """The number of lines read so far: pass it to ``wait_for`` to match only later lines."""
        with self._changed:
            return len(self.lines)

    def wait_for(self, pattern: str | re.Pattern[str], timeout: float, after: int = 0) -> re.Match[str]:
        """The first line after mark ``after`` that matches ``pattern``; ``ChildTimeout`` if none comes in time."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = after
        with self._changed:
            while True:
                for line in self.lines[seen:]:
                    match = regex.search(line)
                    if match is not None:
                        return match
                seen = max(seen, len(self.lines))
                left = deadline - time.monotonic()
                if left <= 0 or (self.process.poll() is not None and not self._reader.is_alive()):
                    raise ChildTimeout(
                        f"{self.name}: no line matching {regex.pattern!r} within {timeout} s (exit code "
                        f"{self.process.poll()}); output tail:\n{self.tail()}"
                    )
                self._changed.wait(min(left, 0.5))

    def tail(self, n: int = 40) -> str:
        """The last ``n`` lines printed."""
        with self._changed:
            return "\n".join(self.lines[-n:])

    def signal(self, sig: Signals) -> None:
        """Send ``sig`` if the child is still running."""
        if self.process.poll() is None:
            self.process.send_signal(sig)

    def stop(self, timeout: float = 20.0, sig: Signals = SIGTERM) -> int:
        """``sig`` and SIGCONT, then SIGKILL after ``timeout`` seconds; the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.send_signal(SIGCONT)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._reader.join(5)
        return self.process.returncode
