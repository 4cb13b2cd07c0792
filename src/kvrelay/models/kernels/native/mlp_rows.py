"""The gated MLP of a few bfloat16 rows in one parallel region: a C kernel (``mlp_rows.c``).

``mlp_rows_native(x, gate, up, down, activation)`` is ``down(act(gate x) * up x)`` for ``x`` of 1 to
``MAX_ROWS`` rows, with ``mlp.GatedMLP``'s post-op numerics up to summation order (the file states them;
``tests/unit/test_native_mlp_rows.py``). Through oneDNN the same MLP is three parallel regions, each a
wake-up of a passive OpenMP partner; here it is one, with a spin barrier between the intermediate and
the output (why and how fast: docs/performance.md, "Decode MLP in one region"). Applies to bfloat16
rows and contiguous bfloat16 weights without bias on the CPU, widths multiples of 32, the activations
of ``ACTIVATION_CODES``, where the kernel is built (``build``); else ``None`` and nothing is computed.
"""

from __future__ import annotations

import ctypes

import torch

from kvrelay.models.kernels.native.build import load

MAX_ROWS = 16
"""The most rows the kernel takes (``mlp_rows.c``'s bound)."""

ACTIVATION_CODES = {"silu": 0, "gelu_tanh": 1, "gelu": 2}
"""The activations the kernel computes, by the name ``mlp_rows_native`` takes, and their code in C."""

_SIGNATURES = (
    (
        "kvrelay_mlp_rows",
        (
            (
                ctypes.c_void_p,
                ctypes.c_int64,
                ctypes.c_int64,
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_int64,
                ctypes.c_void_p,
                ctypes.c_int,
                ctypes.c_void_p,
                ctypes.c_void_p,
            ),
            ctypes.c_int,
        ),
    ),
)


def library() -> ctypes.CDLL | None:
    """The kernel, built and loaded (``None`` where it cannot run)."""
    return load("mlp_rows", _SIGNATURES)


def mlp_rows_native(
    x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, activation: str
) -> torch.Tensor | None:
    """``down(act(gate x) * up x)`` for ``x`` ``[M, H]`` (``1 <= M <= MAX_ROWS``), ``gate`` and ``up`` ``[I, H]``,
    ``down`` ``[H, I]``: ``[M, H]`` bfloat16, or ``None`` where the kernel does not apply."""
    code = ACTIVATION_CODES.get(activation)
    if code is None or x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS:
        return None
    rows, hidden = x.shape
    inner = gate.shape[0]
    tensors = (x, gate, up, down)
    fits = all(t.device.type == "cpu" and t.dtype == torch.bfloat16 and t.dim() == 2 for t in tensors)
    shapes = gate.shape == up.shape == (inner, hidden) and down.shape == (hidden, inner)
    if not fits or not shapes or hidden % 32 or inner % 32 or not all(w.is_contiguous() for w in tensors[1:]):
        return None
    lib = library()
    if lib is None:
        return None
    x = x.contiguous()
    mid = torch.empty(rows, inner, dtype=torch.bfloat16)
    out = torch.empty(rows, hidden, dtype=torch.bfloat16)
    failed = lib.kvrelay_mlp_rows(
        x.data_ptr(),
        rows,
        hidden,
        gate.data_ptr(),
        up.data_ptr(),
        inner,
        down.data_ptr(),
        code,
        mid.data_ptr(),
        out.data_ptr(),
    )
    return None if failed else out
