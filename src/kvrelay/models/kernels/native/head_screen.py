"""The screening pass of ``models.greedy_head``: int8 dots of one row against every head row, with
bounds, in C (AVX-512 VNNI, ``head_screen.c``, which states the arithmetic; on CPUs without
AVX-512 its AVX2 port ``head_screen_avx2.c``, the same functions and results). Where the kernel is
not built, ``screen_rows`` returns ``None`` and the caller computes the full logits. On CPUs with AMX,
``screen_amx`` (``head_screen_amx.c``) screens up to 64 rows in one read of the int8 head, laid out in
tiles by ``pack_tiles``.
"""

from __future__ import annotations

import ctypes

import torch

from kvrelay.models.kernels.native.build import load_amx, load_best

_PTR, _I64, _F64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
_SIGNATURES = (
    (
        "kvrelay_head_screen",
        ((_PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _F64, _F64, _F64, _F64, _PTR, _PTR, _I64), _I64),
    ),
    ("kvrelay_head_quantize", ((_PTR, _I64, _I64, _F64, _F64, _PTR, _PTR, _PTR, _PTR, _PTR), ctypes.c_int)),
)
_AMX_SIGNATURES = (
    ("kvrelay_head_pack_tiles", ((_PTR, _I64, _I64, _PTR), ctypes.c_int)),
    (
        "kvrelay_head_screen_amx",
        ((_PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _I64), ctypes.c_int),
    ),
)
AMX_MAX_ROWS = 64
"""The most input rows ``screen_amx`` takes in one call (``head_screen_amx.c``'s ``MAX_M``)."""


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


def amx_built() -> bool:
    """Whether ``screen_amx`` runs here: the AMX kernel is built (``build.load_amx``) and Linux granted this
    process the tile state."""
    return _amx() is not None


def pack_tiles(q: torch.Tensor, tiles: torch.Tensor) -> bool:
    """Fill ``tiles`` (int8, ``q``'s shape, ``N % 16 == 0``) with ``q`` in the tile order ``screen_amx`` reads;
    False (nothing written) where the AMX kernel does not run."""
    lib = _amx()
    if lib is None or q.shape != tiles.shape or q.shape[0] % 16:
        return False
    return lib.kvrelay_head_pack_tiles(q.data_ptr(), q.shape[0], q.shape[1], tiles.data_ptr()) == 0


def screen_amx(
    parts: torch.Tensor,
    tiles: torch.Tensor,
    row_terms: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    x_terms: torch.Tensor,
    scratch: torch.Tensor,
    threads: int,
    picked: torch.Tensor,
) -> list[int | None] | None:
    """``screen_rows`` for ``M`` input rows in one pass over the int8 head (``head_screen_amx.c``, which states
    the layouts): ``parts`` uint8 ``[2M, K]`` (slices of 8 rows, each slice's coarse parts then its fine ones),
    ``tiles`` from ``pack_tiles``, ``x_terms`` float64 ``[M, 4]``, ``scratch`` float64 with room for
    ``threads * M * 2 * P`` values (at most ``threads`` threads screen), ``picked`` int64 ``[M, P]``. Row
    ``m``'s picked rows are ``picked[m, :count]``; its count, or ``None`` where more than ``P`` were left.
    ``None`` for the whole call where the kernel does not run or the shapes do not fit."""
    lib = _amx()
    rows, room = x_terms.shape[0], picked.shape[1]
    fits = 1 <= rows <= AMX_MAX_ROWS and parts.shape == (2 * rows, tiles.shape[1]) and picked.shape[0] == rows
    if lib is None or not fits or scratch.numel() < threads * rows * 2 * room:
        return None
    rowsum, scale, c1, c2 = row_terms
    counts = torch.empty(rows, dtype=torch.int64)
    status = lib.kvrelay_head_screen_amx(
        parts.data_ptr(),
        tiles.data_ptr(),
        rowsum.data_ptr(),
        scale.data_ptr(),
        c1.data_ptr(),
        c2.data_ptr(),
        tiles.shape[0],
        tiles.shape[1],
        rows,
        x_terms.data_ptr(),
        scratch.data_ptr(),
        threads,
        picked.data_ptr(),
        counts.data_ptr(),
        room,
    )
    if status != 0:
        return None
    return [None if c < 0 else c for c in counts.tolist()]


def _amx() -> ctypes.CDLL | None:
    """The AMX kernel, where it is built and this process may use the tiles; else ``None``."""
    return load_amx("head_screen_amx", _AMX_SIGNATURES)
