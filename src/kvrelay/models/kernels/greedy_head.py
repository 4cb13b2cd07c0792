"""The greedy token of a row without its full logits: screen an int8 copy of the LM head, then
compute only the logits that could be the largest.

Greedy decoding needs the argmax of ``h W^T`` (``W`` the ``[vocab, hidden]`` head), not the
logits. An int8 copy of ``W`` (one scale per row) is half the bytes to stream (why and how fast:
docs/performance.md, "Greedy head screen"). From the int8 dots (``native.head_screen``) and bounds on
everything that separates them from the full head's values (quantizing ``W`` and ``h``, the
float32 sums of the bfloat16 GEMV, its rounding to bfloat16), every row whose logit is surely
below another row's is ruled out; the few left get their exact logits from the same C GEMV the
full head runs (``native.linear_row``, whose value for a row does not depend on the other rows),
and the largest wins, the lowest id on ties (on CPUs without AVX-512, the AVX2 ports of both:
``head_screen_avx2.c`` and the panels of ``native.linear_avx2``, whose value for a row does not depend
on the other rows either). The token is the full head's greedy token
(``tests/unit/test_greedy_head.py``); when the screen leaves too many rows, or does not apply,
the caller computes the full logits. It is the bound-and-verify scheme of quantized
maximum-inner-product search, kept exact. Where the CPU has AMX the screen takes a decode step's rows
together (``head_screen.screen_amx``), each row's token still the one it gets alone, so a sequence's
greedy tokens do not depend on the batch it decodes in.
"""

from __future__ import annotations

import torch

from kvrelay.models.kernels.huge_pages import huge_page_empty
from kvrelay.models.kernels.native import head_screen, linear_avx2
from kvrelay.models.kernels.native.build import best_isa
from kvrelay.models.kernels.native.linear_row import linear_pairs_native, linear_rows_at_native

MAX_PICKED = 16384
"""More rows left than this after the screen: the caller computes the full logits instead (the
exact logits of this many rows still cost a small share of the full head's; how often real rows
leave more: docs/performance.md, "Greedy head screen")."""

_PACK_ROWS = 4096
"""Rows quantized at a time on their way into the AMX tiles (a multiple of 64)."""
_INT8_MAX = 127
_SLACK = 1 + 2.0**-20
"""Widens the bounds for the double arithmetic that computes them."""


class GreedyHead:
    """``argmax(h @ weight.T)`` for bfloat16 rows ``h``, as the full bfloat16 head gives each row alone.

    Holds an int8 copy of ``weight`` (half its bytes) and four numbers per row: row-major (``q``), or, where
    the CPU has AMX, in the tiles its int8 product reads (``tiles``; ``q`` is then ``None``), which screen up
    to ``max_rows`` rows in one read of the copy (a decode step's greedy rows; how fast: docs/performance.md,
    "Greedy head screen"). ``build`` returns ``None`` where the screen does not apply. ``last_left`` is how
    many rows the last decided call left for exact logits (the most of any row).
    """

    def __init__(
        self,
        weight: torch.Tensor,
        q: torch.Tensor | None,
        tiles: torch.Tensor | None,
        row_terms: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    ) -> None:
        self.weight = weight
        self.q = q
        self.tiles = tiles
        self.row_terms = row_terms
        self.max_rows = head_screen.AMX_MAX_ROWS if tiles is not None else 1
        self.last_left = 0
        self._upper = torch.empty(weight.shape[0] if q is not None else 0, dtype=torch.float64)
        self._picked = torch.empty(0, MAX_PICKED, dtype=torch.int64)
        self._scratch = torch.empty(0, dtype=torch.float64)

    @classmethod
    def build(cls, weight: torch.Tensor) -> GreedyHead | None:
        """The screen of ``weight`` (bfloat16 ``[vocab, hidden]`` on the CPU, contiguous, ``vocab`` a multiple
        of 4 and ``hidden`` of 64), or ``None`` where it does not apply or its kernel is not built. The AMX
        tiles need ``vocab`` a multiple of 64."""
        fits = weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
        if (
            not fits
            or not weight.is_contiguous()
            or weight.shape[1] % 64
            or weight.shape[0] % 4
            or weight.shape[0] == 0
        ):
            return None
        rows, width = weight.shape
        row_terms = (
            torch.empty(rows, dtype=torch.int32),
            torch.empty(rows, dtype=torch.float64),
            torch.empty(rows, dtype=torch.float64),
            torch.empty(rows, dtype=torch.float64),
        )
        accumulation = (width + 16) * 2.0**-23
        if rows % 64 == 0 and head_screen.amx_built():
            tiles = huge_page_empty((rows, width), torch.int8)
            staged = torch.empty(min(rows, _PACK_ROWS), width, dtype=torch.int8)
            for start in range(0, rows, _PACK_ROWS):  # row-major copy by pieces: no second whole copy
                end = min(rows, start + _PACK_ROWS)
                rowsum, scale, c1, c2 = (t[start:end] for t in row_terms)
                q = staged[: end - start]
                quantized = head_screen.quantize_rows(
                    weight[start:end], accumulation, _SLACK, q, (rowsum, scale, c1, c2)
                )
                if not quantized or not head_screen.pack_tiles(q, tiles[start:end]):
                    return None
            return cls(weight, None, tiles, row_terms)
        q = huge_page_empty((rows, width), torch.int8)
        if not head_screen.quantize_rows(weight, accumulation, _SLACK, q, row_terms):
            return None
        return cls(weight, q, None, row_terms)

    def argmax(self, h: torch.Tensor) -> int | None:
        """The greedy token of ``h`` (``[1, hidden]`` bfloat16), or ``None`` (nothing decided: take the full
        logits) when the screen leaves more than ``MAX_PICKED`` rows or ``h`` does not fit."""
        if h.shape != (1, self.weight.shape[1]) or h.dtype != torch.bfloat16 or h.device.type != "cpu":
            return None
        if self.tiles is not None:
            tokens = self.argmax_rows(h)
            return None if tokens is None else tokens[0]
        assert self.q is not None
        split = _split(h)
        if split is None:
            return None
        parts, terms = split
        x_terms = (terms[0, 0].item(), terms[0, 1].item(), terms[0, 2].item(), terms[0, 3].item())
        picked = self._picked_rows(1)[0]
        count = head_screen.screen_rows(parts, self.q, self.row_terms, x_terms, self._upper, picked)
        if not count:
            return None
        self.last_left = count
        logits = exact_rows(h, self.weight, picked[:count])
        return None if logits is None else int(picked[int(logits.argmax())])

    def argmax_rows(self, h: torch.Tensor) -> list[int | None] | None:
        """The greedy token of each row of ``h`` (``[M, hidden]`` bfloat16, ``M <= max_rows``), each the one
        ``argmax`` gives its row alone; a row's ``None`` where the screen left more than ``MAX_PICKED`` rows for
        it, and ``None`` for all where ``h`` does not fit."""
        rows = h.shape[0]
        fits = h.dim() == 2 and h.shape[1] == self.weight.shape[1] and h.dtype == torch.bfloat16
        if not fits or h.device.type != "cpu" or not 1 <= rows <= self.max_rows:
            return None
        if self.tiles is None:
            return [self.argmax(h)]
        split = _split(h)
        if split is None:
            return None
        (coarse, fine), terms = split
        parts = torch.cat([torch.cat((coarse[s : s + 8], fine[s : s + 8])) for s in range(0, rows, 8)])
        threads = torch.get_num_threads()
        if self._scratch.numel() < threads * rows * 2 * MAX_PICKED:
            self._scratch = torch.empty(threads * rows * 2 * MAX_PICKED, dtype=torch.float64)
        picked = self._picked_rows(rows)
        counts = head_screen.screen_amx(parts, self.tiles, self.row_terms, terms, self._scratch, threads, picked)
        if counts is None:
            return None
        decided = [m for m, count in enumerate(counts) if count]
        sizes = [counts[m] or 0 for m in decided]
        rows_of = torch.cat([picked[m, : counts[m]] for m in decided]) if decided else picked[0, :0]
        at = torch.repeat_interleave(torch.tensor(decided, dtype=torch.int64), torch.tensor(sizes, dtype=torch.int64))
        logits = linear_pairs_native(h, self.weight, rows_of, at)
        tokens: list[int | None] = [None] * rows
        if logits is not None:
            for m, piece, ids in zip(decided, logits.split(sizes), rows_of.split(sizes), strict=True):
                tokens[m] = int(ids[int(piece.argmax())])
        self.last_left = max(c or 0 for c in counts)
        return tokens

    def _picked_rows(self, rows: int) -> torch.Tensor:
        """Room for ``MAX_PICKED`` row indices per input row, ``[rows, MAX_PICKED]`` (reused between calls)."""
        if self._picked.shape[0] < rows or self._picked.shape[1] != MAX_PICKED:
            self._picked = torch.empty(rows, MAX_PICKED, dtype=torch.int64)
        return self._picked[:rows]


def _split(h: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """Each row of ``h`` as the screen takes it: its coarse and fine int8 parts plus 128 (uint8 ``[M, K]``
    each) and its terms ``(x_scale, g_scale, g_max, x_abs_sum)`` (float64 ``[M, 4]``); ``None`` when a row is
    not finite."""
    x = h.double()
    largest = x.abs().amax(dim=1)
    if not bool(torch.isfinite(largest).all()):
        return None
    x_scale = torch.where(largest > 0, largest / _INT8_MAX, torch.ones_like(largest))
    coarse = torch.round(x / x_scale[:, None])
    rest = x - coarse * x_scale[:, None]
    g_scale = x_scale / (2 * _INT8_MAX)
    fine = torch.round(rest / g_scale[:, None])
    g_max = (rest - fine * g_scale[:, None]).abs().amax(dim=1) * _SLACK
    terms = torch.stack((x_scale, g_scale, g_max, x.abs().sum(dim=1) * _SLACK), dim=1).contiguous()
    return ((coarse + 128).to(torch.uint8), (fine + 128).to(torch.uint8)), terms


def exact_rows(h: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor | None:
    """The head's bfloat16 logits of ``h`` at ``rows``, bit for bit as the model's full head computes them (the
    C GEMV of ``linear_row`` on AVX-512, the panels of ``linear_avx2`` on AVX2); ``None`` where neither runs."""
    if best_isa() == "avx2":
        return linear_avx2.rows_at_native(h, weight, rows)
    return linear_rows_at_native(h, weight, rows)
