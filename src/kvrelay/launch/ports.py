"""Free loopback ports for the servers a supervisor, a test or a benchmark starts.

A port is handed out some time before its server binds it (a server started as a child binds it seconds
later). One taken from the kernel's ephemeral range (``bind(0)``) can be handed out by the kernel again in
that window: to another ``bind(0)`` (vLLM's and torch's own port pickers, ZeroMQ) or as the local end of an
outgoing connection, and the server then fails to start. So ports come from just below that range, which the
kernel never hands out by itself, drawn at random, checked free by binding them, and never handed out twice by
one process while they may still be waiting for their server.
"""

from __future__ import annotations

import random
import socket
import threading
from collections import deque
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
SPAN = 12_000
"""How many ports below the ephemeral range are drawn from."""
RECENT = 512
"""How many ports handed out last this process will not hand out again."""

_recent: deque[int] = deque(maxlen=RECENT)
_lock = threading.Lock()
_rng = random.SystemRandom()


def port_span(ephemeral_range: str) -> range:
    """The ports drawn from, given the kernel's ``ip_local_port_range`` text (``"32768\\t60999"``): the
    ``SPAN`` ports below its first, starting no lower than 10000."""
    low = int(ephemeral_range.split()[0])
    return range(max(10_000, low - SPAN), low)


def _span() -> range:
    try:
        return port_span(EPHEMERAL_RANGE.read_text())
    except (OSError, ValueError, IndexError):
        return port_span("32768 60999")


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bound, then released), outside the kernel's
    ephemeral range and not handed out by this process among its last ``RECENT`` (see the module contract); one
    from the kernel where no such port is found in 200 draws."""
    span = _span()
    with _lock:
        for _ in range(200 if span else 0):
            port = _rng.choice(span)
            if port not in _recent and _bindable(port):
                _recent.append(port)
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
