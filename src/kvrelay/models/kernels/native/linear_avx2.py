"""bfloat16 projections on CPUs with AVX2 and FMA but no bfloat16 arithmetic: a C kernel (``linear_avx2.c``).

There oneDNN has no bfloat16 kernel and PyTorch's bfloat16 ``F.linear`` runs a generic loop (why and how fast:
docs/performance.md, "AVX2 projections"). ``Panels.build(weight)`` lays a ``[N, K]`` bfloat16 weight out once
as the kernel reads it (as much memory again); ``panels(x)`` is ``F.linear(x, weight, bias)`` for bfloat16
``x [M, K]``: every output the float32 chain of products over ``k`` in order plus the bias, rounded once to
bfloat16, the same whatever the batch (``linear_avx2.c`` states it). ``rows_at_native(x, weight, rows)`` gives
a single row's outputs at chosen weight rows, bit for bit as ``Panels`` gives them. Applies where ``build``
picks the AVX2 kernels (``best_isa() == "avx2"``) to contiguous bfloat16 tensors on the CPU.
"""

from __future__ import annotations

import ctypes

import torch

from kvrelay.models.kernels.huge_pages import huge_page_empty
from kvrelay.models.kernels.native.build import best_isa, load

_PTR, _I64 = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = (
    ("kvrelay_pack_panels_avx2", ((_PTR, _I64, _I64, _PTR), ctypes.c_int)),
    ("kvrelay_linear_avx2", ((_PTR, _I64, _PTR, _PTR, _I64, _I64, _PTR, _I64), ctypes.c_int)),
    ("kvrelay_linear_rows_at_avx2", ((_PTR, _PTR, _I64, _PTR, _I64, _PTR), ctypes.c_int)),
)
PANEL_ROWS = 16


def library() -> ctypes.CDLL | None:
    """The kernel where the AVX2 kernels are the ones to take here, else ``None``."""
    return load("linear_avx2", _SIGNATURES, "avx2") if best_isa() == "avx2" else None


class Panels:
    """A bfloat16 weight ``[N, K]`` (and bias ``[N]``) laid out for ``linear_avx2.c``; call it on rows."""

    def __init__(
        self, lib: ctypes.CDLL, panels: torch.Tensor, bias: torch.Tensor | None, rows: int, width: int
    ) -> None:
        self.lib = lib
        self.panels = panels
        self.bias = bias
        self.rows = rows
        self.width = width

    @classmethod
    def build(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Panels | None:
        """The panels of ``weight``, or ``None`` where the kernel does not apply (see the module docstring)."""
        lib = library()
        tensors = [weight] + ([] if bias is None else [bias])
        if lib is None or not all(t.device.type == "cpu" and t.dtype == torch.bfloat16 for t in tensors):
            return None
        if weight.dim() != 2 or 0 in weight.shape or (bias is not None and bias.shape != (weight.shape[0],)):
            return None
        rows, width = weight.shape
        panels = huge_page_empty((-(-rows // PANEL_ROWS), width, PANEL_ROWS), torch.bfloat16)
        if lib.kvrelay_pack_panels_avx2(weight.contiguous().data_ptr(), rows, width, panels.data_ptr()) != 0:
            return None
        return cls(lib, panels, None if bias is None else bias.contiguous(), rows, width)

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """``F.linear(x, weight, bias)`` for bfloat16 ``x [M, K]`` on the CPU; ``None`` (nothing computed) for other
        inputs."""
        if x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.dim() != 2:
            return None
        if x.shape[1] != self.width or x.shape[0] == 0:
            return None
        x = x.contiguous()
        out = torch.empty(x.shape[0], self.rows, dtype=torch.bfloat16)
        bias = None if self.bias is None else self.bias.data_ptr()
        status = self.lib.kvrelay_linear_avx2(
            x.data_ptr(), x.shape[0], self.panels.data_ptr(), bias, self.rows, self.width, out.data_ptr(), self.rows
        )
        return out if status == 0 else None


def rows_at_native(x: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor | None:
    """``Panels.build(weight)(x)[0, rows]`` for one bfloat16 row ``x [1, K]`` (no bias), computing only those
    outputs (``rows`` int64 ``[C]``, in range); ``None`` where the kernel does not apply."""
    lib = library()
    fits = all(t.device.type == "cpu" and t.dtype == torch.bfloat16 and t.dim() == 2 for t in (x, weight))
    if lib is None or not fits or x.shape[0] != 1 or x.shape[1] != weight.shape[1] or not weight.is_contiguous():
        return None
    if rows.dtype != torch.int64 or rows.dim() != 1:
        return None
    x, rows = x.contiguous(), rows.contiguous()
    out = torch.empty(rows.shape[0], dtype=torch.bfloat16)
    status = lib.kvrelay_linear_rows_at_avx2(
        x.data_ptr(), weight.data_ptr(), weight.shape[1], rows.data_ptr(), rows.shape[0], out.data_ptr()
    )
    return out if status == 0 else None
