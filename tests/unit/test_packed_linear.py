"""Packed (oneDNN) projections and the MLP's fused activation agree with plain PyTorch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kvrelay.models.layers import Weights
from kvrelay.models.mlp import ACTIVATIONS, GatedMLP, PackedLinear

HIDDEN, INNER = 64, 192
needs_packing = pytest.mark.skipif(
    PackedLinear(torch.zeros(8, 8, dtype=torch.bfloat16)).packed is None,
    reason="this torch build cannot pack bfloat16 weights for oneDNN",
)


def _mlp(activation: str, max_rows: int | None = None) -> tuple[GatedMLP, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    tensors = {
        "model.embed_tokens.weight": torch.zeros(4, HIDDEN),
        "model.layers.0.mlp.gate_proj.weight": torch.randn(INNER, HIDDEN, generator=gen) / HIDDEN**0.5,
        "model.layers.0.mlp.up_proj.weight": torch.randn(INNER, HIDDEN, generator=gen) / HIDDEN**0.5,
        "model.layers.0.mlp.down_proj.weight": torch.randn(HIDDEN, INNER, generator=gen) / INNER**0.5,
    }
    config = SimpleNamespace(hidden_size=HIDDEN, intermediate_size=INNER, hidden_activation=activation)
    mlp = GatedMLP(Weights(tensors, torch.bfloat16, torch.device("cpu")), "model.layers.0.mlp", config)  # type: ignore[arg-type]
    if max_rows is not None:
        for proj in (mlp.gate, mlp.up, mlp.down):
            proj.max_rows = max_rows
    return mlp, tensors


def _reference(tensors: dict[str, torch.Tensor], activation: str, x: torch.Tensor) -> torch.Tensor:
    """The MLP in float32 on the bfloat16-rounded weights."""
    w = {k.rsplit(".", 2)[-2]: v.bfloat16().float() for k, v in tensors.items() if "mlp" in k}
    xf = x.float()
    return F.linear(
        ACTIVATIONS[activation].fn(F.linear(xf, w["gate_proj"])) * F.linear(xf, w["up_proj"]), w["down_proj"]
    )


@needs_packing
def test_packed_projection_matches_plain_linear() -> None:
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(96, HIDDEN, generator=gen).bfloat16()
    bias = torch.randn(96, generator=gen).bfloat16()
    proj = PackedLinear(weight, bias, max_rows=16)
    x = torch.randn(16, HIDDEN, generator=gen).bfloat16()
    assert proj.packs(x) and not proj.packs(torch.zeros(17, HIDDEN, dtype=torch.bfloat16))
    torch.testing.assert_close(proj(x).float(), F.linear(x, weight, bias).float(), rtol=1e-2, atol=1e-2)


def test_float32_weights_are_not_packed() -> None:
    proj = PackedLinear(torch.randn(8, 8))
    assert proj.packed is None and not proj.packs(torch.zeros(2, 8))


@needs_packing
@pytest.mark.parametrize("activation", ["gelu_pytorch_tanh", "silu", "gelu"])
def test_fused_mlp_matches_the_float32_mlp_to_bfloat16_rounding(activation: str) -> None:
    mlp, tensors = _mlp(activation)
    x = torch.randn(32, HIDDEN, generator=torch.Generator().manual_seed(5)).bfloat16()
    assert mlp.gate.packs(x)
    want = _reference(tensors, activation, x)
    got = mlp(x).float()
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()


@needs_packing
def test_rows_beyond_the_packed_limit_still_take_the_post_ops() -> None:
    whole, tensors = _mlp("gelu_pytorch_tanh")
    limited, _ = _mlp("gelu_pytorch_tanh", max_rows=4)
    x = torch.randn(10, HIDDEN, generator=torch.Generator().manual_seed(9)).bfloat16()
    assert whole.gate.packs(x) and not limited.gate.packs(x) and limited.gate.packed_for(x)
    want = _reference(tensors, "gelu_pytorch_tanh", x)
    got = limited(x)
    act = ACTIVATIONS["gelu_pytorch_tanh"]
    assert torch.equal(got, limited.down(limited.up.times(x, limited.gate.activated(x, act))))
    for result in (whole(x).float(), got.float()):
        assert (result - want).abs().max() <= 2e-2 * want.abs().max()
