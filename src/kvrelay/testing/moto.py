"""A real ``moto_server`` on a free loopback port, as a context manager.

``running_moto_server()`` starts ``moto_server -H 127.0.0.1 -p PORT`` as a
subprocess, polls until it answers HTTP (bounded by ``start_timeout_s``), yields
its endpoint URL and stops it (terminate, then kill) on exit. The tests' fixture
``moto_endpoint`` (``tests/support/fixtures.py``) wraps it; benchmarks use it directly.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvrelay.testing.ports import free_port

POLL_INTERVAL_S = 0.05


def moto_server_command() -> str:
    """The ``moto_server`` executable beside this Python, else on PATH; a clear error if absent."""
    beside_python = Path(sys.executable).with_name("moto_server")
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("moto_server")
    if found is None:
        raise RuntimeError("moto_server is not installed; install the dev extras: pip install -e '.[dev]'")
    return found


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


@contextmanager
def running_moto_server(start_timeout_s: float = 30.0) -> Iterator[str]:
    """Run a moto_server on loopback; yields its endpoint URL (``http://127.0.0.1:PORT``)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    proc = subprocess.Popen(
        [moto_server_command(), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        deadline = time.monotonic() + start_timeout_s
        while not _answers(url):
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                raise RuntimeError(f"moto_server exited with {proc.returncode} before answering: {err[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"moto_server did not answer on {url} within {start_timeout_s} s")
            time.sleep(POLL_INTERVAL_S)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stderr:
            proc.stderr.close()
