"""The ready line a serving command prints on stdout, which launchers and tests wait for."""

from __future__ import annotations

import sys


def say_ready(line: str) -> None:
    """Write ``line`` and its newline to stdout in one write. With stdout unbuffered (``PYTHONUNBUFFERED``, as the
    launchers and tests set it) ``print`` writes the text and the newline separately, and a log line from another
    thread sharing the pipe landed between them once, so a waiter matching the whole line never saw it."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
