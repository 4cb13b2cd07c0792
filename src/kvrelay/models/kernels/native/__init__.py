"""C kernels for bfloat16 on CPUs with AVX-512 BF16, each with a PyTorch path that serves wherever it does not apply.

``attention`` (batched decode attention), ``rms_norm`` (RMS norm, with the residual
add or the rope that follows it) and ``linear_row`` (a single-row projection) wrap
their ``.c`` sources, which ``build`` compiles on first use; ``head_screen.c`` is
``models.greedy_head``'s screen (``head_screen``).
"""

from __future__ import annotations

from kvrelay.models.kernels.native import attention, head_screen, linear_row, rms_norm
from kvrelay.models.kernels.native.build import load


def load_all() -> bool:
    """Build (or find in the cache) and load every kernel now, so no forward pays for it; whether all loaded."""
    kernels = (
        ("decode_attention", attention._SIGNATURES),
        ("rms_norm", rms_norm._SIGNATURES),
        ("linear_row", linear_row._SIGNATURES),
        ("head_screen", head_screen._SIGNATURES),
    )
    return all(load(name, signatures) is not None for name, signatures in kernels)
