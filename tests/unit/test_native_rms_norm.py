"""The C RMS norm gives what ``RMSNorm``'s PyTorch path gives, up to the last bfloat16 bit.

The kernel sums squares in another order than torch, so a few outputs may differ
in their last bit; the checks allow that and no more. Shapes the kernel does not
take fall back to PyTorch.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvrelay.models import layers
from kvrelay.models.kernels.native import build
from kvrelay.models.kernels.native.rms_norm import _SIGNATURES, add_rms_norm_native, rms_norm_native
from kvrelay.models.layers import RMSNorm, Rotary, apply_rope
from tests.support.bf16_close import assert_last_bit_close

needs_kernel = pytest.mark.skipif(
    build.load_best("rms_norm", _SIGNATURES) is None,
    reason="the native kernel does not run here (no AVX2 or no C compiler)",
)


@pytest.fixture
def pytorch_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``RMSNorm`` on its PyTorch path, as without the kernel."""
    monkeypatch.setattr(layers, "rms_norm_native", lambda *args, **kwargs: None)
    monkeypatch.setattr(layers, "add_rms_norm_native", lambda *args: False)
    yield


def rows(*shape: int, seed: int = 0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3).bfloat16()


def weight(*shape: int, seed: int = 1) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.5).bfloat16()


@needs_kernel
@pytest.mark.parametrize("unit_offset", [True, False])
@pytest.mark.parametrize("tokens", [1, 32, 300])
def test_rows_match_the_pytorch_norm(unit_offset: bool, tokens: int, monkeypatch: pytest.MonkeyPatch, isa: str) -> None:
    norm = RMSNorm(weight(640), 1e-6, unit_offset)
    x = rows(tokens, 640)
    got = norm(x)
    with monkeypatch.context() as patch:
        patch.setattr(layers, "rms_norm_native", lambda *args: None)
        want = norm(x)
    assert torch.equal(got, rms_norm_native(x, norm.kernel_weight, 1e-6, unit_offset))
    assert_last_bit_close(got, want)


@needs_kernel
def test_per_head_norm_of_a_strided_view_matches(monkeypatch: pytest.MonkeyPatch, isa: str) -> None:
    """The fused q/k norm reads ``[T, heads, D]`` heads out of the wider qkv projection."""
    qkv = rows(9, 6 * 256)
    qk = qkv[:, : 5 * 256].view(9, 5, 256)
    norm = RMSNorm(torch.stack([weight(256, seed=2)] * 4 + [weight(256, seed=3)]), 1e-6, unit_offset=True)
    got = rms_norm_native(qk, norm.kernel_weight, 1e-6, True)
    with monkeypatch.context() as patch:
        patch.setattr(layers, "rms_norm_native", lambda *args: None)
        want = norm(qk)
    assert got is not None and got.shape == (9, 5, 256)
    assert_last_bit_close(got, want)


@needs_kernel
@pytest.mark.parametrize("unit_offset", [True, False])
def test_add_to_matches_adding_the_norm(unit_offset: bool, pytorch_only: None, isa: str) -> None:
    norm = RMSNorm(weight(640), 1e-6, unit_offset)
    base, x = rows(32, 640, seed=4), rows(32, 640, seed=5)
    want = base.clone().add_(norm(x))
    got = base.clone()
    assert add_rms_norm_native(got, x, norm.kernel_weight, 1e-6, unit_offset)
    assert_last_bit_close(got, want)


def test_add_to_falls_back_and_adds(pytorch_only: None) -> None:
    norm = RMSNorm(weight(24).float(), 1e-6, unit_offset=True)
    base, x = rows(3, 24).float(), rows(3, 24, seed=6).float()
    want = base + norm(x)
    assert norm.add_to(base, x) is base
    torch.testing.assert_close(base, want, rtol=0, atol=0)


@pytest.mark.parametrize("change", ["float32", "dim 24", "strided last dim", "weight of other heads", "no rows"])
def test_shapes_the_kernel_does_not_take_fall_back(change: str) -> None:
    x, w = rows(4, 64), torch.ones(64)
    if change == "float32":
        x = x.float()
    elif change == "dim 24":
        x, w = x[:, :24].contiguous(), w[:24]
    elif change == "strided last dim":
        x = rows(4, 128)[:, ::2]
    elif change == "weight of other heads":
        x, w = rows(4, 3, 64), torch.ones(2, 64)
    else:
        x = x[:0]
    assert rms_norm_native(x, w, 1e-6, True) is None
    if x.dim() == 2:
        base = torch.zeros(x.shape, dtype=x.dtype)
        assert not add_rms_norm_native(base, x, w, 1e-6, True)
        assert not base.any()


def rope_tables(tokens: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(100, 100 + tokens)
    return Rotary(dim, 10_000.0, torch.device("cpu")).cos_sin(positions, torch.bfloat16)


@needs_kernel
def test_norm_then_rope_is_apply_rope_of_the_norm(isa: str) -> None:
    """Rope's three roundings are the same in C as in ``apply_rope``: bit for bit, given the same norm."""
    qkv = rows(7, 6 * 256, seed=8)
    qk = qkv[:, : 5 * 256].view(7, 5, 256)
    norm = RMSNorm(torch.stack([weight(256, seed=9)] * 4 + [weight(256, seed=10)]), 1e-6, unit_offset=True)
    cos, sin = rope_tables(7, 256)
    normed = rms_norm_native(qk, norm.kernel_weight, 1e-6, True)
    assert normed is not None
    assert torch.equal(norm.then_rope(qk, cos, sin), apply_rope(normed, cos, sin))


def test_then_rope_without_the_kernel_is_apply_rope_of_the_norm(pytorch_only: None) -> None:
    qk = rows(3, 2, 64, seed=11)
    norm = RMSNorm(weight(64, seed=12), 1e-6, unit_offset=False)
    cos, sin = rope_tables(3, 64)
    assert torch.equal(norm.then_rope(qk, cos, sin), apply_rope(norm(qk), cos, sin))


@needs_kernel
def test_rope_tables_of_another_shape_fall_back() -> None:
    qk = rows(3, 2, 64, seed=13)
    cos, sin = rope_tables(4, 64)
    assert rms_norm_native(qk, torch.ones(64), 1e-6, True, rope=(cos, sin)) is None
