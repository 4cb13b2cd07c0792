"""The orphan reaper kills the vLLM processes it was given once its input ends, and spares any other pid."""

from __future__ import annotations

import subprocess

from kvrelay.launch.orphan_reaper import is_vllm_process, reap
from tests.support.processes import wait_until


def test_the_reaper_kills_the_vllm_processes_it_was_given_and_spares_the_rest() -> None:
    engine = subprocess.Popen(["bash", "-c", "exec -a VLLM::EngineCore sleep 60"])
    other = subprocess.Popen(["sleep", "60"])
    try:
        wait_until(lambda: is_vllm_process(engine.pid) or None, 10, "bash to exec the named process")
        assert not is_vllm_process(other.pid)
        killed = reap([f"{engine.pid}\n".encode(), f"{other.pid}\n".encode(), b"not a pid\n"])
        assert killed == [engine.pid]
        assert engine.wait(10) == -9
        assert other.poll() is None
    finally:
        for child in (engine, other):
            child.kill()
            child.wait()
