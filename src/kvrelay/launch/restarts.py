"""When ``kvrelay cluster`` restarts a child that exited, and how it says so (pure functions, no clock).

Contract:
- ``decide(code, restarts, now, policy)``: a child that exited with ``code`` (``Popen.returncode``: negative
  for a signal) and was restarted at the times ``restarts`` before is restarted unless it stopped cleanly
  (code 0: it was stopped on purpose and drained) or it was already restarted ``policy.max_restarts`` times
  within the last ``policy.window_s`` seconds (a crash loop that restarting does not fix). The n-th restart
  within the window waits ``first_delay_s * 2**(n-1)``, at most ``max_delay_s``.
- ``describe_exit(code)``: the exit status in words ("code 1", "signal SIGKILL").
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    max_restarts: int = 5
    """Restarts of one child allowed within ``window_s``; one more crash and it stays down."""
    window_s: float = 60.0
    first_delay_s: float = 0.5
    max_delay_s: float = 10.0


class Verdict(Enum):
    RESTART = "restart"
    CLEAN_EXIT = "clean_exit"
    """Exit code 0: the child was stopped on purpose (a signal it handled, its drain done)."""
    TOO_MANY = "too_many"
    """It crashed again after ``max_restarts`` restarts within ``window_s``."""


@dataclass(frozen=True, slots=True)
class Decision:
    verdict: Verdict
    delay_s: float = 0.0
    recent: int = 0
    """Restarts within the window before this decision."""


def decide(code: int, restarts: Sequence[float], now: float, policy: RestartPolicy) -> Decision:
    """Whether (and after how long) to restart a child that exited with ``code`` (see the module contract)."""
    recent = sum(1 for at in restarts if now - at <= policy.window_s)
    if code == 0:
        return Decision(Verdict.CLEAN_EXIT, recent=recent)
    if recent >= policy.max_restarts:
        return Decision(Verdict.TOO_MANY, recent=recent)
    delay = min(policy.max_delay_s, policy.first_delay_s * 2**recent)
    return Decision(Verdict.RESTART, delay, recent)


def describe_exit(code: int) -> str:
    """``code`` in words: "code N", or "signal NAME" for a child killed by a signal."""
    if code >= 0:
        return f"code {code}"
    try:
        return f"signal {signal.Signals(-code).name}"
    except ValueError:
        return f"signal {-code}"
