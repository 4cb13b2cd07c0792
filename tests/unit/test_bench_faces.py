"""A bench face whose process exits before it is ready says which process, its exit code and its log's end."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from kvrelay.bench.trace.client import wait_ready
from kvrelay.bench.trace.faces import Face, spawn, until
from kvrelay.testing.ports import free_port

FAILING = "import sys; print('first line'); print('no engine fits: KV cache too small', flush=True); sys.exit(3)"


def failing_face(home: Path) -> Face:
    face = Face("broken", f"http://127.0.0.1:{free_port()}", home)
    spawn(face, "router", [sys.executable, "-c", FAILING], {"PATH": "/usr/bin:/bin"})
    face.processes[0][1].wait(timeout=30)
    return face


def test_waiting_on_a_face_whose_process_exited_reports_its_code_and_log(tmp_path: Path) -> None:
    face = failing_face(tmp_path)
    with pytest.raises(RuntimeError) as caught:
        asyncio.run(wait_ready(face.url, "m", face, limit_s=30))
    message = str(caught.value)
    assert "router exited with code 3" in message
    assert "no engine fits: KV cache too small" in message
    assert str(tmp_path / "router.log") in message


def test_the_exit_report_keeps_the_logs_last_lines_and_is_empty_while_all_run(tmp_path: Path) -> None:
    face = failing_face(tmp_path)
    report = face.exit_report(lines=1)
    assert "KV cache too small" in report and "first line" not in report
    running = Face("alive", "http://127.0.0.1:1", tmp_path / "alive")
    running.home.mkdir()
    spawn(running, "sleeper", [sys.executable, "-c", "import time; time.sleep(60)"], {"PATH": "/usr/bin:/bin"})
    try:
        assert running.exit_report() == ""
    finally:
        running.stop(grace_s=5)


def test_a_readiness_probe_on_a_stopped_face_reports_the_exit(tmp_path: Path) -> None:
    face = failing_face(tmp_path)
    with pytest.raises(RuntimeError, match="router exited with code 3"):
        asyncio.run(until(lambda: False, face, limit_s=30))
