"""``keep_freed_memory``: memory a thread frees is reused by its next allocations, not faulted in again."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvrelay.worker.runtime.heap_reuse import keep_freed_memory

ROUNDS = """
import resource, sys, threading
import numpy as np
from kvrelay.worker.runtime.heap_reuse import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()

def faults():
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt

def rounds(out):
    for _ in range(6):  # what a forward does: large blocks allocated, written, freed
        before = faults()
        blocks = [np.ones(16 << 20, dtype=np.uint8) for _ in range(3)]
        del blocks
        out.append(faults() - before)

out = []
thread = threading.Thread(target=rounds, args=(out,))  # a thread arena, as the device thread's
thread.start()
thread.join()
print(*out)
"""


def faults_per_round(mode: str) -> list[int]:
    done = subprocess.run([sys.executable, "-c", ROUNDS, mode], capture_output=True, text=True, timeout=120, check=True)
    return [int(n) for n in done.stdout.split()]


def test_freed_blocks_are_reused_without_page_faults_once_kept() -> None:
    if not keep_freed_memory():
        pytest.skip("this C library has no mallopt (not glibc)")
    kept = faults_per_round("keep")
    default = faults_per_round("default")
    assert kept[0] > 0, "the first round touches fresh memory"
    assert sum(kept[1:]) == 0, f"the kept process faulted its freed memory in again: {kept}"
    assert min(default[1:]) > 0, f"glibc's defaults hand these blocks back each round (the case kept): {default}"
