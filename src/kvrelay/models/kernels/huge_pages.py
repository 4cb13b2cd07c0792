"""Large CPU tensors on 2 MiB transparent huge pages (Linux ``madvise(MADV_HUGEPAGE)``).

The runtime streams hundreds of megabytes per step: the tied LM head for
every prompt's last token, the sliding-window rings and the page pool for
every decode step. On 4 KiB pages that is one translation per 4 KiB, and after
a prefill has evicted the page tables from the caches each one is a walk to
memory (why and how fast: docs/performance.md, "Huge pages"). PyTorch's CPU
allocator gives huge pages only when ``THP_MEM_ALLOC_ENABLE=1`` is set before
its first allocation; this module asks for them explicitly for the tensors the
runtime owns, whatever the environment and the import order.

The kernel grants them where transparent huge pages are ``always`` or
``madvise`` (``/sys/kernel/mm/transparent_hugepage/enabled``) and it has free
2 MiB frames; elsewhere the memory is ordinary pages and nothing else changes.
``KVRELAY_HUGE_PAGES=0`` turns the advice off.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
import sys

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """An uninitialised contiguous tensor of ``shape`` and ``dtype`` on ``device``.

    On the CPU, when it has at least ``HUGE_PAGE`` bytes and the advice is available (Linux,
    not turned off), its data starts on a 2 MiB boundary and its whole range was
    advised ``MADV_HUGEPAGE`` before anything touched it; its storage is then up to
    2 MiB longer than its data. Otherwise it is ``torch.empty(shape, dtype=dtype, device=device)``.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes < HUGE_PAGE or not _advice_enabled():
        return torch.empty(shape, dtype=dtype, device=device)
    span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    raw = torch.empty(span + HUGE_PAGE, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE
    if not _advise(raw.data_ptr() + offset, span):
        return torch.empty(shape, dtype=dtype)
    return raw[offset : offset + nbytes].view(dtype).view(shape)


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype, device=device)``, on huge pages on the CPU (``huge_page_empty``)."""
    return huge_page_empty(shape, dtype, device).zero_()


def copy_to_huge_pages(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous copy of the CPU ``tensor`` converted to ``dtype``, on huge pages (``huge_page_empty``)."""
    if tensor.device.type != "cpu":
        raise ValueError(f"copy_to_huge_pages takes CPU tensors; got one on {tensor.device}")
    return huge_page_empty(tuple(tensor.shape), dtype).copy_(tensor)


def _advice_enabled() -> bool:
    return sys.platform == "linux" and os.environ.get("KVRELAY_HUGE_PAGES", "1") != "0"


def _advise(address: int, length: int) -> bool:
    """``madvise(address, length, MADV_HUGEPAGE)``; False (logged once) when the kernel refuses it."""
    libc = _libc()
    if libc is None:
        return False
    if libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), _MADV_HUGEPAGE) == 0:
        return True
    _warn_refused(os.strerror(ctypes.get_errno()))
    return False


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        libc.madvise.restype = ctypes.c_int
    except (OSError, AttributeError) as exc:
        log.info("huge pages unavailable: no madvise in this process (%s); large tensors use ordinary pages", exc)
        return None
    return libc


@functools.cache
def _warn_refused(reason: str) -> None:
    log.info("the kernel refused MADV_HUGEPAGE (%s); large tensors use ordinary pages", reason)
