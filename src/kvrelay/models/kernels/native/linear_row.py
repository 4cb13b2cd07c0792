"""A CPU fast path for a single-row bfloat16 projection (a GEMV): a C kernel.

``linear_row.c`` reads each weight row once, with software prefetch. It takes
single rows only (the LM head row of every prefill), where it beats oneDNN's
packed kernel; from two rows on oneDNN is as fast or faster (why and how fast:
docs/performance.md, "Single-row projection"). ``linear_rows_at_native`` and
``linear_pairs_native`` compute chosen outputs only (the greedy screen's exact
logits), each as the full GEMV gives it; below 256 outputs on one thread. The numerics are ``F.linear``'s
in bfloat16 up to summation order (``tests/unit/test_native_linear_row.py``).
Applies to a bfloat16 ``[1, K]`` row and a contiguous bfloat16 weight on the CPU,
``K`` a multiple of 32, no bias, where the kernel is built (``build``).
"""

from __future__ import annotations

import ctypes

import torch

from kvrelay.models.kernels.native.build import load

_SIGNATURES = (
    (
        "kvrelay_linear_row",
        ((ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p), ctypes.c_int),
    ),
    (
        "kvrelay_linear_pairs",
        (
            (
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_int64,
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_int64,
                ctypes.c_void_p,
            ),
            ctypes.c_int,
        ),
    ),
    (
        "kvrelay_linear_rows_at",
        (
            (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p),
            ctypes.c_int,
        ),
    ),
)


def linear_row_native(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``F.linear(x, weight)`` for ``x`` ``[1, K]`` and ``weight`` ``[N, K]``; ``None`` if the kernel does not
    apply (nothing computed)."""
    lib = _library_for(x, weight)
    if lib is None or weight.shape[0] == 0:
        return None
    x = x.contiguous()
    out = torch.empty(1, weight.shape[0], dtype=torch.bfloat16)
    lib.kvrelay_linear_row(x.data_ptr(), weight.data_ptr(), weight.shape[0], weight.shape[1], out.data_ptr())
    return out


def linear_rows_at_native(x: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor | None:
    """``linear_row_native(x, weight)[0, rows]`` (``rows`` int64 ``[C]``, in range) computing only those
    outputs, each exactly as the full GEMV computes it; ``None`` if the kernel does not apply."""
    lib = _library_for(x, weight)
    if lib is None or rows.dtype != torch.int64 or rows.dim() != 1:
        return None
    x, rows = x.contiguous(), rows.contiguous()
    out = torch.empty(rows.shape[0], dtype=torch.bfloat16)
    lib.kvrelay_linear_rows_at(
        x.data_ptr(), weight.data_ptr(), weight.shape[1], rows.data_ptr(), rows.shape[0], out.data_ptr()
    )
    return out


def _library_for(x: torch.Tensor, weight: torch.Tensor) -> ctypes.CDLL | None:
    """The kernel, when it is built and takes ``x`` (bfloat16 ``[1, K]``, ``K % 32 == 0``) against ``weight``
    (contiguous bfloat16 ``[N, K]``), both on the CPU; else ``None``."""
    tensors_fit = all(t.device.type == "cpu" and t.dtype == torch.bfloat16 and t.dim() == 2 for t in (x, weight))
    if not tensors_fit or x.shape[0] != 1 or x.shape[1] != weight.shape[1] or x.shape[1] % 32:
        return None
    return load("linear_row", _SIGNATURES) if weight.is_contiguous() else None


def linear_pairs_native(
    x: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor, at: torch.Tensor
) -> torch.Tensor | None:
    """``linear_rows_at_native(x[at[j]:at[j] + 1], weight, rows[j:j + 1])`` for every ``j``, in one call
    (``x`` ``[M, K]``; ``rows`` and ``at`` int64 ``[C]``, in range); ``None`` if the kernel does not apply."""
    lib = _library_for(x[:1], weight) if x.dim() == 2 and x.shape[0] >= 1 else None
    if lib is None or rows.dtype != torch.int64 or at.dtype != torch.int64 or rows.shape != at.shape:
        return None
    x, rows, at = x.contiguous(), rows.contiguous(), at.contiguous()
    out = torch.empty(rows.shape[0], dtype=torch.bfloat16)
    lib.kvrelay_linear_pairs(
        x.data_ptr(), weight.data_ptr(), weight.shape[1], rows.data_ptr(), at.data_ptr(), rows.shape[0], out.data_ptr()
    )
    return out
