"""A CPU fast path for RMS norm of bfloat16 rows, and for a residual add of a normed tensor: a C kernel.

In PyTorch a norm is eight small ops (cast, square, mean, add, rsqrt, two
products, cast back); ``rms_norm.c`` does a row in one pass (why and how fast:
docs/performance.md, "RMS norm"). ``add_rms_norm_native`` also folds in the
residual add that follows Gemma's post-attention and post-feedforward norms, and
``rms_norm_native(..., rope=...)`` the rotation that follows the q/k norm.
The numerics are ``layers.RMSNorm``'s; only the order of the sum of squares
differs (``tests/unit/test_native_rms_norm.py``). Applies to contiguous-row
bfloat16 tensors on the CPU whose last dim is a multiple of 16, where the kernel
is built (``build``: AVX-512, or its AVX2 port ``rms_norm_avx2.c``); elsewhere the callers take their
PyTorch path.
"""

from __future__ import annotations

import ctypes

import torch

from kvrelay.models.kernels.native.build import load_best

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = (
    (
        "kvrelay_rms_norm",
        ((_PTR, _I64, _I64, _I64, _I64, _PTR, _I64, ctypes.c_float, ctypes.c_int, _PTR), ctypes.c_int),
    ),
    ("kvrelay_add_rms_norm", ((_PTR, _PTR, _I64, _I64, _PTR, ctypes.c_float, ctypes.c_int), ctypes.c_int)),
    (
        "kvrelay_rms_norm_rope",
        (
            (_PTR, _I64, _I64, _I64, _I64, _PTR, _I64, ctypes.c_float, ctypes.c_int, _PTR, _PTR, _PTR),
            ctypes.c_int,
        ),
    ),
)


def rms_norm_native(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    unit_offset: bool,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """``RMSNorm`` of ``x`` (``[T, D]`` or ``[T, H, D]``, rows contiguous) with ``weight`` (float32, ``[D]``
    or ``[H, D]``; ``1 + w`` when ``unit_offset``), then, given ``rope`` (``cos`` and signed ``sin``,
    ``[T, 1, D]``), ``apply_rope``; ``None`` if the kernel does not apply (nothing computed)."""
    if not _applies(x, weight) or x.dim() not in (2, 3):
        return None
    heads = 1 if x.dim() == 2 else x.shape[1]
    if x.stride(-1) != 1 or (x.dim() == 3 and x.stride(1) != x.shape[2]):
        return None
    if weight.dim() == 2 and weight.shape[0] != heads:
        return None
    if rope is not None and not _rope_fits(x, *rope):
        return None
    lib = load_best("rms_norm", _SIGNATURES)
    if lib is None:
        return None
    out = torch.empty(x.shape, dtype=x.dtype)
    args = (
        x.data_ptr(),
        x.shape[0],
        heads,
        x.shape[-1],
        x.stride(0),
        weight.data_ptr(),
        weight.shape[0] if weight.dim() == 2 else 1,
        eps,
        int(unit_offset),
    )
    if rope is None:
        status = lib.kvrelay_rms_norm(*args, out.data_ptr())
    else:
        status = lib.kvrelay_rms_norm_rope(*args, rope[0].data_ptr(), rope[1].data_ptr(), out.data_ptr())
    return out if status == 0 else None


def add_rms_norm_native(
    base: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool
) -> bool:
    """``base += RMSNorm(x)`` in place (both contiguous ``[T, D]``, ``weight`` ``[D]`` float32), rounding as
    ``base.add_(norm(x))`` does; ``False`` if the kernel does not apply (then ``base`` is untouched)."""
    if not (_applies(x, weight) and weight.dim() == 1 and x.dim() == 2 and x.is_contiguous()):
        return False
    if base.shape != x.shape or base.dtype != x.dtype or base.device != x.device or not base.is_contiguous():
        return False
    lib = load_best("rms_norm", _SIGNATURES)
    if lib is None:
        return False
    status = lib.kvrelay_add_rms_norm(
        base.data_ptr(), x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), eps, int(unit_offset)
    )
    return status == 0


def _applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype == torch.bfloat16
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and weight.is_contiguous()
        and weight.shape[-1] == x.shape[-1]
        and x.shape[-1] % 16 == 0
        and x.shape[0] > 0
    )


def _rope_fits(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    want = (x.shape[0], 1, x.shape[-1])
    return (
        all(
            t.shape == want and t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.is_contiguous()
            for t in (cos, sin)
        )
        and x.shape[-1] % 32 == 0
        and x.shape[-1] <= 1024
    )
