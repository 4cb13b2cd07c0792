"""Torch's intra-op thread pool belongs to the device thread alone.

PyTorch's CPU build parallelises an op with OpenMP (libgomp), which gives every
OS thread that opens a parallel region a team of its own. Once two teams exist
on a machine with no more cores than one team has threads, libgomp counts more
managed threads than CPUs and its idle workers stop spinning, so every parallel
op pays a wake-up (how much: docs/performance.md, "Torch thread pools").

``confine_threads`` sets torch's process-wide count to one, so every thread
runs its torch ops serially; a process that runs a ``PagedRuntime`` calls it
before its first torch op (model loading included; ``PagedRuntime`` calls it
too). ``own_pool`` then gives the device thread its pool through libgomp's
per-thread setting, leaving every other thread serial. Where torch's libgomp
is not found it falls back to torch's process-wide count. ``name_os_thread`` gives the
device thread its name in the OS too, before its team exists, so that the team's threads,
which take their creator's name, are told from the process's others in ``top -H``, ``perf``
and ``/proc/PID/task/TID/comm``.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
from collections.abc import Callable

import torch

_pool_threads: list[int] = []
"""Torch's thread count at the first confinement: the size of the device thread's pool."""


def confine_threads() -> int:
    """Make torch ops run on one thread in every thread but a device thread; return the device pool's size.

    The pool's size is torch's thread count at the first call in the process.
    """
    if not _pool_threads:
        _pool_threads.append(torch.get_num_threads())
    torch.set_num_threads(1)
    return _pool_threads[0]


def own_pool(threads: int) -> None:
    """Give the calling thread (the device thread) ``threads`` torch threads."""
    torch.get_num_threads()  # torch sets a thread's count from the process-wide one on its first use
    set_this_thread = _omp_set_num_threads()
    if set_this_thread is None:
        torch.set_num_threads(threads)
    else:
        set_this_thread(threads)


PR_SET_NAME = 15
"""``prctl``'s option that names the calling thread (``linux/prctl.h``)."""
OS_NAME_BYTES = 15
"""The longest OS thread name Linux keeps (16 bytes with the terminating zero)."""


def name_os_thread(name: str) -> None:
    """Name the calling thread ``name`` in the OS (cut to ``OS_NAME_BYTES``), where it has ``prctl`` (Linux)."""
    try:
        prctl = ctypes.CDLL(None).prctl
    except (OSError, AttributeError):
        return
    prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:OS_NAME_BYTES]), 0, 0, 0)


@functools.cache
def _omp_set_num_threads() -> Callable[[int], object] | None:
    """libgomp's ``omp_set_num_threads`` (the calling thread's count) from torch's own copy, if present."""
    found = sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*")))
    if not found:
        return None
    try:
        return ctypes.CDLL(found[0]).omp_set_num_threads
    except (OSError, AttributeError):
        return None
