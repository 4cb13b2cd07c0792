"""A CPU fast path for batched decode attention: a C kernel (AVX-512 BF16, or its AVX2 port
``decode_attention_avx2.c``), compiled on first use.

``decode_attention`` in PyTorch reads a decode step's keys and values through two
batched matmuls plus a softmax and the copies between them. ``decode_attention.c``
reads each visible key and value row once, with software prefetch, and keeps the
scores in the core's cache (why and how fast: docs/performance.md, "Decode
attention kernel").

Numerics are the PyTorch path's in bfloat16 (scores rounded to bfloat16 before
scaling, softmax in float32, probabilities rounded to bfloat16, float32
accumulation); only the summation order differs, so an output can differ in its
last bit (``tests/unit/test_native_attention.py``).

It runs its sequences on the calling thread's OpenMP team (``build``). It is
used only where it applies (CPU, bfloat16, query heads per KV head a multiple of
4, head dim a multiple of 128, and the kernel built here); anything else takes the
PyTorch path, which stays the reference, and the one for CUDA.
"""

from __future__ import annotations

import ctypes

import torch

from kvrelay.models.kernels.native.build import load_best

MAX_KEYS = 4095
"""The most keys one query may see (the C kernel's ``MAX_KEYS - 1``)."""
_SIGNATURES = (
    (
        "kvrelay_decode_attention",
        (
            (ctypes.c_void_p,) * 5
            + (ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int)
            + (ctypes.c_int64,) * 4
            + (ctypes.c_float,),
            ctypes.c_int,
        ),
    ),
)


def decode_attention_native(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float
) -> torch.Tensor | None:
    """``decode_attention`` where sequence ``b`` sees its first ``visible[b]`` keys; ``None`` if the kernel
    does not apply here (then nothing was computed).

    ``q`` is ``[B, kv_heads, group, D]``; ``k`` and ``v`` are ``[B, kv_heads, S, D]``, strided alike with
    unit stride in the last dim (views of rings or gathered pages do); ``visible`` is ``[B]``, on the
    CPU, each in ``1 .. S``. Returns ``[B, kv_heads, group, D]``.
    """
    if not _applies(q, k, v, visible):
        return None
    lib = load_best("decode_attention", _SIGNATURES)
    if lib is None:
        return None
    batch, kv_heads, group, dim = q.shape
    q = q.contiguous()
    counts = visible.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    batch_stride, head_stride, row_stride, _ = k.stride()
    status = lib.kvrelay_decode_attention(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        counts.data_ptr(),
        out.data_ptr(),
        batch,
        kv_heads,
        group,
        dim,
        k.shape[2],
        batch_stride,
        head_stride,
        row_stride,
        scale,
    )
    if status != 0:
        raise ValueError(
            f"native decode attention rejected q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"visible {visible.tolist()}: each visible count must be in 1..{k.shape[2]}"
        )
    return out


def _applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> bool:
    if any(t.device.type != "cpu" or t.dtype != torch.bfloat16 or t.dim() != 4 for t in (q, k, v)):
        return False
    batch, kv_heads, group, dim = q.shape
    shapes_fit = k.shape == v.shape and k.shape[:2] == (batch, kv_heads) and k.shape[3] == dim
    strides_fit = k.stride() == v.stride() and k.stride(3) == 1
    kernel_fits = group % 4 == 0 and group <= 16 and dim % 128 == 0 and 0 < k.shape[2] <= MAX_KEYS
    return shapes_fit and strides_fit and kernel_fits and batch > 0 and visible.shape == (batch,)
