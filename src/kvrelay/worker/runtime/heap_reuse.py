"""The C heap keeps what a forward frees for the next forward (glibc's ``malloc``).

A prefill forward allocates and frees hundreds of megabytes of intermediates (a 4,096-token chunk of
Gemma 3 270M: 16 MiB for each MLP activation, 12 MiB for the query, key and value rows, ...). Under
glibc's defaults a process may settle, by the history of its allocations, into returning that memory to
the kernel after every forward (blocks mapped and unmapped, a heap's top trimmed, a thread arena's
emptied heap unmapped whole) and taking a page fault, and the kernel's zeroing, for every 4 KiB the next
forward touches again: about 100,000 faults and 0.11 s of a cold 4,096-token prefill on the 2-core AMX
VM, in some processes and not others (docs/performance.md, "Freed memory kept for the next forward").

``keep_freed_memory`` sets, process-wide through ``mallopt``, the three parameters that return memory:
blocks up to ``MMAP_THRESHOLD_BYTES`` come from the heaps, a heap keeps up to ``TRIM_THRESHOLD_BYTES``
free at its top, and ``TOP_PAD_BYTES`` of slack keeps a thread arena's emptied heap mapped (glibc's
``heap_trim`` deletes a heap only when the one before it has more than the pad free). Memory stays
mapped at the process's peak use instead of being handed back between forwards. Where the C library has
no ``mallopt`` (musl, macOS) or refuses a value, the process keeps the library's defaults. vLLM's CPU
server gets the same from the tcmalloc it preloads.
"""

from __future__ import annotations

import ctypes
import functools
import logging

log = logging.getLogger(__name__)

# mallopt's parameter numbers (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD_BYTES = 32 << 20
"""Blocks of at most this many bytes come from the heaps: glibc's largest mmap threshold on 64-bit
(half its 64 MiB arena heap)."""
TRIM_THRESHOLD_BYTES = 1 << 30
"""Free memory a heap's top may hold before glibc returns any of it."""
TOP_PAD_BYTES = 64 << 20
"""Slack glibc adds to each heap's growth; as large as a thread arena's heap, so an emptied heap is kept."""


@functools.cache
def keep_freed_memory() -> bool:
    """Set the process's ``malloc`` to keep freed memory mapped for reuse; whether every setting took.

    Idempotent; call it before the threads that run forwards allocate (``PagedRuntime`` does).
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        log.info("freed memory goes back to the OS between forwards: this C library has no mallopt")
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    settings = (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
        (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
        (M_TOP_PAD, TOP_PAD_BYTES),
    )
    refused = [parameter for parameter, value in settings if mallopt(parameter, value) != 1]
    if refused:
        log.info("mallopt refused parameters %s; freed memory may go back to the OS between forwards", refused)
    return not refused
