"""Prefill attention in C (``prefill_attention_amx.c`` on AMX tiles, ``prefill_attention_avx512.c`` with AVX-512
BF16 dot products), compiled on first use.

One prefilling sequence's queries over its gathered keys, causal with an optional
sliding window, as ``models.kernels.prefill_attention`` defines it: per KV head the
query heads sharing it are rows of one matrix, and each 32 rows score only the
32-key blocks some of them sees (torch's fused kernel with a mask scores every
pair of its key range: a 256-query block of a 512-key sliding window scored 767
keys a query). Scores, softmax and sums in float32, the probabilities rounded to
bfloat16 for the second product as torch's fused kernel rounds them; only the
order of float summation differs. A row's output depends on its own query and
keys alone, whichever rows share its tile.

Each applies to bfloat16 on CPU where its kernel loads (``NativePrefill.library``), with a head dim a multiple of
64 up to 512 and keys of unit stride along the head dim; ``None`` elsewhere, and
the caller takes torch's path.
"""

from __future__ import annotations

import ctypes
import threading
from enum import Enum

import torch

from kvrelay.models.kernels.native.build import Signature, best_isa, load, load_amx

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_SCRATCH = ("kvrelay_prefill_attention_scratch", ((_I64,) * 6, _I64))
_ATTEND = ((_P,) * 4 + (_I64,) * 11 + (ctypes.c_float, _P, _I64), ctypes.c_int)
MAX_HEAD_DIM = 512


class NativePrefill(Enum):
    """kvrelay's C prefill attention kernels: the value names the source (``prefill_attention_<value>.c``) and its
    entry point (``kvrelay_prefill_attention_<value>``)."""

    AMX = "amx"
    """On AMX tiles (``TDPBF16PS``)."""
    AVX512 = "avx512"
    """With AVX-512 BF16 dot products (``VDPBF16PS``), for CPUs without AMX tiles."""

    @property
    def entry(self) -> str:
        """The kernel's C function."""
        return f"kvrelay_prefill_attention_{self.value}"

    @property
    def signatures(self) -> tuple[tuple[str, Signature], ...]:
        return (_SCRATCH, (self.entry, _ATTEND))

    def library(self) -> ctypes.CDLL | None:
        """The kernel's library where it loads here, else ``None``."""
        name = f"prefill_attention_{self.value}"
        if self is NativePrefill.AMX:
            return load_amx(name, self.signatures)
        return load(name, self.signatures) if best_isa() == "avx512" else None


class _Scratch(threading.local):
    """Each thread's reused scratch (grown, never shrunk): a fresh one per call faulted in its pages every time."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)

    def take(self, size: int) -> torch.Tensor:
        if self.buffer.numel() < size:
            self.buffer = torch.empty(size + 63, dtype=torch.uint8)
        return self.buffer


_scratch = _Scratch()


def native_prefill_attention(
    kind: NativePrefill,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    first_query: int,
    first_key: int,
    window: int | None,
    scale: float,
) -> torch.Tensor | None:
    """Attention ``[Q, heads, D]`` of queries ``q`` (``[Q, heads, D]``, each query's heads contiguous; query ``t``
    at ``first_query + t``) over ``k``, ``v`` (``[kv_heads, S, D]``, key ``i`` at ``first_key + i``), causal and,
    with a ``window``, sliding, by the kernel ``kind``; ``None`` where it does not load or apply (nothing computed
    then).

    The keys must reach the last query's position and start at or before the first query's (``ValueError``).
    """
    if not _applies(q, k, v):
        return None
    lib = kind.library()
    if lib is None:
        return None
    queries, heads, dim = q.shape
    kv_heads, keys, _ = k.shape
    out = torch.empty(q.shape, dtype=q.dtype)
    threads = torch.get_num_threads()
    size = lib.kvrelay_prefill_attention_scratch(queries, heads, kv_heads, dim, keys, threads)
    buffer = _scratch.take(size)
    aligned = buffer.data_ptr() + (-buffer.data_ptr() % 64)
    status = getattr(lib, kind.entry)(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        out.data_ptr(),
        queries,
        q.stride(0),
        heads,
        kv_heads,
        dim,
        keys,
        k.stride(0),
        k.stride(1),
        first_query,
        first_key,
        window or 0,
        scale,
        aligned,
        threads,
    )
    if status != 0:
        raise ValueError(
            f"prefill attention rejected {queries} queries from position {first_query} over {keys} keys from "
            f"position {first_key}: the keys must start at or before the first query and reach the last"
        )
    return out


def _applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    if any(t.device.type != "cpu" or t.dtype != torch.bfloat16 or t.dim() != 3 for t in (q, k, v)):
        return False
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = k.shape[0]
    return (
        q.stride(2) == 1
        and q.stride(1) == dim
        and k.shape == v.shape
        and k.shape[2] == dim
        and k.stride() == v.stride()
        and k.stride(2) == 1
        and heads % kv_heads == 0
        and dim % 64 == 0
        and dim <= MAX_HEAD_DIM
    )
