"""``bench.engines.servers.wait_quiet`` waits while a server's process tree burns CPU, not after."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvrelay.bench.engines.servers import EngineServer, wait_quiet

BUSY_THEN_SLEEP = """
import time
while time.process_time() < 0.5:
    pass
print("idle", flush=True)
time.sleep(60)
"""


def _server(tmp_path: Path, code: str) -> EngineServer:
    log = (tmp_path / "log").open("wb")
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=log)
    return EngineServer("busy", "http://127.0.0.1:9", "m", process, log)


def test_returns_only_once_a_busy_server_has_gone_idle(tmp_path: Path) -> None:
    server = _server(tmp_path, BUSY_THEN_SLEEP)
    try:
        waited = wait_quiet([server], timeout_s=30.0)
        assert server.cpu_seconds() >= 0.45, "returned while the server was still burning its 0.5 s of CPU"
        assert waited < 30.0
        assert server.process.stdout is not None and server.process.stdout.readline() == b"idle\n"
    finally:
        server.process.kill()
        server.stop()


def test_an_idle_server_is_quiet_at_once(tmp_path: Path) -> None:
    server = _server(tmp_path, "import time; print('idle', flush=True); time.sleep(60)")
    try:
        assert server.process.stdout is not None and server.process.stdout.readline() == b"idle\n"
        assert wait_quiet([server], timeout_s=30.0) < 5.0
    finally:
        server.process.kill()
        server.stop()
