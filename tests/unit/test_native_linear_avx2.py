"""The AVX2 projections (``native.linear_avx2``) give every output as one float32 chain over ``k``, whatever the
batch, and the model's projections take them where the kernels are the AVX2 ones.

The reference chain is computed in torch: a product of two bfloat16 numbers is exact in float32, so adding the
products one ``k`` at a time in float32 rounds exactly as the kernel's fused multiply-adds do.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from kvrelay.models.kernels.native import build
from kvrelay.models.kernels.native.linear_avx2 import Panels, rows_at_native
from kvrelay.models.mlp import PackedLinear

needs_avx2 = pytest.mark.skipif(not build.cpu_supports("avx2"), reason="this CPU lacks AVX2 and FMA")


@pytest.fixture(autouse=True)
def avx2(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The AVX2 kernels are the ones to take, on any CPU that has them."""
    monkeypatch.setenv(build.ISA_ENV, "avx2")
    build.clear_caches()
    yield
    monkeypatch.undo()
    build.clear_caches()


def bf16(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def chain(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Each output as the float32 chain of its products over k in order (plus the bias), rounded to bfloat16."""
    xf, wf = x.float(), weight.float()
    acc = torch.zeros(x.shape[0], weight.shape[0])
    for k in range(x.shape[1]):
        acc = acc + xf[:, k : k + 1] * wf[:, k]
    if bias is not None:
        acc = acc + bias.float()
    return acc.bfloat16()


@needs_avx2
@pytest.mark.parametrize(("rows", "out", "width"), [(1, 37, 13), (5, 100, 64), (12, 33, 40), (19, 48, 96)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_every_output_is_its_float32_chain(rows: int, out: int, width: int, with_bias: bool) -> None:
    x, weight = bf16(rows, width, seed=1), bf16(out, width, seed=2)
    bias = bf16(out, seed=3) if with_bias else None
    panels = Panels.build(weight, bias)
    assert panels is not None
    got = panels(x)
    assert got is not None and torch.equal(got, chain(x, weight, bias))


@needs_avx2
def test_a_row_gives_the_same_outputs_alone_and_in_any_batch() -> None:
    weight = bf16(70, 64, seed=4)
    panels = Panels.build(weight)
    assert panels is not None
    batch = bf16(23, 64, seed=5)  # 23 rows: micro-kernel blocks of 6 and a remainder, panels widened to float32
    together = panels(batch)
    assert together is not None
    for i in (0, 7, 22):
        alone = panels(batch[i : i + 1])
        assert alone is not None and torch.equal(alone[0], together[i])


@needs_avx2
def test_chosen_rows_give_the_panels_values_bit_for_bit() -> None:
    weight, x = bf16(1003, 96, seed=6), bf16(1, 96, seed=7)
    panels = Panels.build(weight)
    assert panels is not None
    full = panels(x)
    rows = torch.tensor([0, 5, 17, 998, 1002], dtype=torch.int64)
    picked = rows_at_native(x, weight, rows)
    assert full is not None and picked is not None
    assert torch.equal(picked, full[0, rows])


@needs_avx2
def test_inputs_the_kernel_does_not_take_get_none() -> None:
    weight = bf16(16, 32, seed=8)
    panels = Panels.build(weight)
    assert panels is not None
    assert panels(bf16(2, 32, seed=9).float()) is None
    assert panels(bf16(2, 31, seed=9)) is None
    assert panels(bf16(2, 4, 32, seed=9)) is None
    assert Panels.build(weight.float()) is None
    assert Panels.build(weight, bias=bf16(15, seed=10)) is None


@needs_avx2
def test_packed_linear_takes_the_panels_where_the_kernels_are_avx2() -> None:
    weight, bias, x = bf16(48, 64, seed=11), bf16(48, seed=12), bf16(9, 64, seed=13)
    projection = PackedLinear(weight, bias)
    assert projection.panels is not None and projection.packed is None
    assert torch.equal(projection(x), chain(x, weight, bias))
    assert torch.equal(PackedLinear(weight.float())(x.float()), F.linear(x.float(), weight.float()))


def test_without_the_avx2_kernels_packed_linear_is_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(build.DISABLE_ENV, "0")
    build.clear_caches()
    try:
        weight, x = bf16(16, 32, seed=14), bf16(3, 32, seed=15)
        projection = PackedLinear(weight)
    finally:
        build.clear_caches()
    assert projection.panels is None
    assert torch.equal(projection(x), F.linear(x, weight))
