"""C kernels for bfloat16 on CPUs: AVX-512 BF16 ones and their AVX2 ports (``<name>_avx2.c``), each with a
PyTorch path that serves wherever it does not apply.

``attention`` (batched decode attention), ``rms_norm`` (RMS norm, with the residual add or the rope that
follows it), ``linear_row`` (a single-row projection, AVX-512 only) and ``mlp_rows`` (a decode step's
gated MLP, or a layer's whole work after its attention, in one parallel region; AVX-512 only, with
``mlp_rows_amx.c`` for CPUs with AMX) wrap their ``.c`` sources, which
``build`` compiles on first use for the instruction set it picks (``build.best_isa``); ``head_screen.c`` is
``models.greedy_head``'s screen (``head_screen``, with ``head_screen_amx.c`` for CPUs with AMX);
``linear_avx2`` holds the projections of CPUs without bfloat16 arithmetic, where oneDNN has none;
``prefill_attention`` a prefill's attention (``prefill_attention_avx512.c``, ``prefill_attention_amx.c``).
"""

from __future__ import annotations

from kvrelay.models.kernels.native import attention, head_screen, linear_avx2, linear_row, mlp_rows, rms_norm
from kvrelay.models.kernels.native.build import best_isa, load, load_best
from kvrelay.models.kernels.native.prefill_attention import NativePrefill


def load_all() -> bool:
    """Build (or find in the cache) and load every kernel of ``best_isa()`` now, so no forward pays for it;
    whether all loaded."""
    ported = (
        ("decode_attention", attention._SIGNATURES),
        ("rms_norm", rms_norm._SIGNATURES),
        ("head_screen", head_screen._SIGNATURES),
    )
    loaded = [load_best(name, signatures) is not None for name, signatures in ported]
    if best_isa() == "avx512":
        loaded.append(load("linear_row", linear_row._SIGNATURES) is not None)
        loaded.append(mlp_rows.library() is not None)
        loaded.append(NativePrefill.AVX512.library() is not None)
        head_screen.amx_built()  # where the CPU has AMX; else nothing to load
        mlp_rows.amx_library()
        NativePrefill.AMX.library()
    else:
        loaded.append(linear_avx2.library() is not None)
    return all(loaded)
