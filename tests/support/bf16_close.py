"""Comparing a C kernel's bfloat16 output with the PyTorch path it replaces."""

from __future__ import annotations

import torch


def assert_last_bit_close(got: torch.Tensor, want: torch.Tensor, units: int = 1) -> None:
    """``got`` is within ``units`` bfloat16 units in the last place of ``want``'s largest value, and at least
    97 % of it is bit-identical (the kernels sum in another order than oneDNN, nothing more)."""
    ulp = 2.0 ** (torch.floor(torch.log2(want.float().abs().max())) - 7)
    assert (got.float() - want.float()).abs().max() <= units * ulp
    assert (got == want).float().mean() >= 0.97
