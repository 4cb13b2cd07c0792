"""Engine processes that must not outlive this process: a child that kills them once this process is gone.

vLLM's engine core (``VLLM::EngineCore``, the child an in-process engine starts) does not watch its parent: when
the router that built it is killed (``kill -9``, the OOM killer), it keeps running, spinning a core and holding its
KV event port, so a restarted router cannot build its engine again. ``watch(pids)`` hands the pids to a reaper
child (started on first use: ``python -m kvrelay.launch.orphan_reaper``, in a session of its own so a signal to the
router's process group leaves it to do its work), which reads them from its stdin; its stdin ends when this process
ends, however it ends, and the reaper then sends SIGKILL to every pid it was given that is still a vLLM process
(its command line starts with ``VLLM::``, so a reused pid is spared). A router that shuts down cleanly has stopped
its engines already, and the reaper finds nothing to kill.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterable

from kvrelay.engines.vllm.in_process import is_vllm_process

_lock = threading.Lock()
_reaper: subprocess.Popen[bytes] | None = None


def watch(pids: Iterable[int]) -> None:
    """Kill these processes when this process ends (see the module docstring)."""
    global _reaper
    lines = b"".join(f"{pid}\n".encode() for pid in pids)
    if not lines:
        return
    with _lock:
        if _reaper is None or _reaper.poll() is not None:
            argv = [sys.executable, "-m", "kvrelay.launch.orphan_reaper"]
            _reaper = subprocess.Popen(argv, stdin=subprocess.PIPE, start_new_session=True)
        assert _reaper.stdin is not None
        _reaper.stdin.write(lines)
        _reaper.stdin.flush()


def reap(lines: Iterable[bytes]) -> list[int]:
    """Read pids until the input ends, then SIGKILL those still vLLM processes; the pids killed."""
    pids = [int(line) for line in lines if line.strip().isdigit()]
    killed = []
    for pid in pids:
        if is_vllm_process(pid):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                continue
    return killed


if __name__ == "__main__":
    reap(sys.stdin.buffer)
