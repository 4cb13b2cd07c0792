"""Free loopback ports for servers that tests and benchmarks start (the supervisor's own, ``launch.ports``)."""

from __future__ import annotations

from kvrelay.launch.ports import free_port

__all__ = ["free_port"]
