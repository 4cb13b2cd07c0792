"""The C single-row projection gives what ``F.linear`` gives in bfloat16, up to the last bit.

The kernel sums in another order than oneDNN, so a few outputs may differ in
their last bfloat16 bit; the checks allow that and no more. Rows the kernel does
not take fall back to oneDNN or ``F.linear``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvrelay.models.kernels.native import build
from kvrelay.models.kernels.native.linear_row import (
    _SIGNATURES,
    linear_pairs_native,
    linear_row_native,
    linear_rows_at_native,
)
from kvrelay.models.mlp import PackedLinear
from tests.support.bf16_close import assert_last_bit_close

needs_kernel = pytest.mark.skipif(
    build.load("linear_row", _SIGNATURES) is None,
    reason="the native kernel does not run here (no AVX-512 BF16 or no C compiler)",
)


def tensor(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


@needs_kernel
@pytest.mark.parametrize(("n", "k"), [(1000, 640), (3, 64), (2049, 2048)])
def test_row_matches_f_linear(n: int, k: int) -> None:
    x, w = tensor(1, k, seed=n), tensor(n, k, seed=k)
    got = linear_row_native(x, w)
    want = F.linear(x, w)
    assert got is not None and got.shape == (1, n)
    assert_last_bit_close(got, want)


@needs_kernel
def test_packed_linear_sends_single_rows_to_the_kernel() -> None:
    w = tensor(300, 640, seed=1)
    x = tensor(1, 640, seed=2)
    assert torch.equal(PackedLinear(w)(x), linear_row_native(x, w))


@pytest.mark.parametrize("change", ["float32", "two rows", "k of 48", "strided weight", "width mismatch"])
def test_inputs_the_kernel_does_not_take_fall_back(change: str) -> None:
    x, w = tensor(1, 64, seed=3), tensor(8, 64, seed=4)
    if change == "float32":
        x, w = x.float(), w.float()
    elif change == "two rows":
        x = tensor(2, 64, seed=5)
    elif change == "k of 48":
        x, w = x[:, :48], w[:, :48].contiguous()
    elif change == "strided weight":
        w = tensor(8, 128, seed=6)[:, ::2]
    else:
        w = tensor(8, 96, seed=7)
    assert linear_row_native(x, w) is None


@needs_kernel
@pytest.mark.parametrize("count", [5, 300])  # below and above the kernel's parallel threshold
def test_pairs_give_each_inputs_chosen_rows_as_its_own_gemv_does(count: int) -> None:
    seed = 77 + count
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    x, w = tensor(4, 640, seed=seed), tensor(1000, 640, seed=seed + 1)
    rows = torch.randint(0, 1000, (count,), generator=gen)
    at = torch.randint(0, 4, (count,), generator=gen)
    got = linear_pairs_native(x, w, rows, at)
    assert got is not None
    for j in range(count):
        alone = linear_rows_at_native(x[int(at[j]) : int(at[j]) + 1], w, rows[j : j + 1])
        assert alone is not None and torch.equal(got[j : j + 1], alone)
    assert linear_pairs_native(x, w, rows, at[:-1]) is None
