"""The screening pass of ``models.greedy_head``: int8 dots of one row against every head row, with
bounds, in C (AVX-512 VNNI, ``head_screen.c``, which states the arithmetic; on CPUs without
AVX-512 its AVX2 port ``head_screen_avx2.c``, the same functions and results). Where the kernel is
not built, ``screen_rows`` returns ``None`` and the caller computes the full logits.
"""

from __future__ import annotations

import ctypes

import torch

from kvrelay.models.kernels.native.build import load_best

_PTR, _I64, _F64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
_SIGNATURES = (
    (
        "kvrelay_head_screen",
        ((_PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _F64, _F64, _F64, _F64, _PTR, _PTR, _I64), _I64),
    ),
    ("kvrelay_head_quantize", ((_PTR, _I64, _I64, _F64, _F64, _PTR, _PTR, _PTR, _PTR, _PTR), ctypes.c_int)),
)


def built() -> bool:
    """Whether the kernel runs here."""
    return load_best("head_screen", _SIGNATURES) is not None


def quantize_rows(
    weight: torch.Tensor,
    accumulation: float,
    slack: float,
    q: torch.Tensor,
    row_terms: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
) -> bool:
    """Fill ``q`` (int8, ``weight``'s shape) and ``row_terms`` (``rowsum`` int32, ``scale``, ``c1``, ``c2``
    float64) from the bfloat16 ``weight`` as ``head_screen.c`` states; False (nothing written) when the
    kernel is not built."""
    lib = load_best("head_screen", _SIGNATURES)
    if lib is None:
        return False
    rowsum, scale, c1, c2 = row_terms
    status = lib.kvrelay_head_quantize(
        weight.data_ptr(),
        weight.shape[0],
        weight.shape[1],
        accumulation,
        slack,
        q.data_ptr(),
        rowsum.data_ptr(),
        scale.data_ptr(),
        c1.data_ptr(),
        c2.data_ptr(),
    )
    return status == 0


def screen_rows(
    parts: tuple[torch.Tensor, torch.Tensor],
    q: torch.Tensor,
    row_terms: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    x_terms: tuple[float, float, float, float],
    upper: torch.Tensor,
    picked: torch.Tensor,
) -> int | None:
    """Rows of ``q`` (int8 ``[N, K]``, ``N % 4 == 0``) whose bfloat16 logit may be the largest, written
    ascending into ``picked`` (int64); their count, or ``None`` when more than ``len(picked)`` are left
    or the kernel is not built. ``parts`` are the row's two int8 parts plus 128 (uint8 ``[K]`` each);
    ``row_terms`` are ``rowsum`` (int32), ``scale``, ``c1`` and ``c2`` (float64, ``[N]`` each);
    ``x_terms`` the parts' scales, the largest error left and the sum of the row's magnitudes;
    ``upper`` (float64 ``[N]``) is scratch.
    """
    lib = load_best("head_screen", _SIGNATURES)
    if lib is None:
        return None
    rowsum, scale, c1, c2 = row_terms
    count = lib.kvrelay_head_screen(
        parts[0].data_ptr(),
        parts[1].data_ptr(),
        q.data_ptr(),
        rowsum.data_ptr(),
        scale.data_ptr(),
        c1.data_ptr(),
        c2.data_ptr(),
        q.shape[0],
        q.shape[1],
        *x_terms,
        upper.data_ptr(),
        picked.data_ptr(),
        picked.shape[0],
    )
    return None if count < 0 else int(count)
