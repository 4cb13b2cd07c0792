"""The greedy token of one row without its full logits: screen an int8 copy of the LM head, then
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
maximum-inner-product search, kept exact.
"""

from __future__ import annotations

import torch

from kvrelay.models.kernels.huge_pages import huge_page_empty
from kvrelay.models.kernels.native import head_screen, linear_avx2
from kvrelay.models.kernels.native.build import best_isa
from kvrelay.models.kernels.native.linear_row import linear_rows_at_native

MAX_PICKED = 16384
"""More rows left than this after the screen: the caller computes the full logits instead (the
exact logits of this many rows still cost a small share of the full head's; how often real rows
leave more: docs/performance.md, "Greedy head screen")."""

_INT8_MAX = 127
_SLACK = 1 + 2.0**-20
"""Widens the bounds for the double arithmetic that computes them."""


class GreedyHead:
    """``argmax(h @ weight.T)`` for one bfloat16 row ``h``, as the full bfloat16 head gives it.

    Holds an int8 copy of ``weight`` (half its bytes) and four numbers per row. ``build`` returns
    ``None`` where the screen does not apply. ``last_left`` is how many rows the last decided
    ``argmax`` left for exact logits.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        q: torch.Tensor,
        row_terms: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    ) -> None:
        self.weight = weight
        self.q = q
        self.row_terms = row_terms
        self.last_left = 0
        self._upper = torch.empty(weight.shape[0], dtype=torch.float64)
        self._picked = torch.empty(MAX_PICKED, dtype=torch.int64)

    @classmethod
    def build(cls, weight: torch.Tensor) -> GreedyHead | None:
        """The screen of ``weight`` (bfloat16 ``[vocab, hidden]`` on the CPU, contiguous, ``vocab`` a multiple
        of 4 and ``hidden`` of 64), or ``None`` where it does not apply or its kernel is not built."""
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
        q = huge_page_empty((rows, width), torch.int8)
        row_terms = (
            torch.empty(rows, dtype=torch.int32),
            torch.empty(rows, dtype=torch.float64),
            torch.empty(rows, dtype=torch.float64),
            torch.empty(rows, dtype=torch.float64),
        )
        accumulation = (width + 16) * 2.0**-23
        if not head_screen.quantize_rows(weight, accumulation, _SLACK, q, row_terms):
            return None
        return cls(weight, q, row_terms)

    def argmax(self, h: torch.Tensor) -> int | None:
        """The greedy token of ``h`` (``[1, hidden]`` bfloat16), or ``None`` (nothing decided: take the full
        logits) when the screen leaves more than ``MAX_PICKED`` rows or ``h`` does not fit."""
        if h.shape != (1, self.weight.shape[1]) or h.dtype != torch.bfloat16 or h.device.type != "cpu":
            return None
        x = h[0].double()
        largest = float(x.abs().max())
        if not largest < float("inf"):
            return None
        x_scale = largest / _INT8_MAX if largest > 0 else 1.0
        coarse = torch.round(x / x_scale)
        rest = x - coarse * x_scale
        g_scale = x_scale / (2 * _INT8_MAX)
        fine = torch.round(rest / g_scale)
        g_max = float((rest - fine * g_scale).abs().max()) * _SLACK
        x_terms = (x_scale, g_scale, g_max, float(x.abs().sum()) * _SLACK)
        parts = ((coarse + 128).to(torch.uint8), (fine + 128).to(torch.uint8))
        count = head_screen.screen_rows(parts, self.q, self.row_terms, x_terms, self._upper, self._picked)
        if not count:
            return None
        self.last_left = count
        picked = self._picked[:count]
        logits = exact_rows(h, self.weight, picked)
        return None if logits is None else int(picked[int(logits.argmax())])


def exact_rows(h: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor | None:
    """The head's bfloat16 logits of ``h`` at ``rows``, bit for bit as the model's full head computes them (the
    C GEMV of ``linear_row`` on AVX-512, the panels of ``linear_avx2`` on AVX2); ``None`` where neither runs."""
    if best_isa() == "avx2":
        return linear_avx2.rows_at_native(h, weight, rows)
    return linear_rows_at_native(h, weight, rows)
