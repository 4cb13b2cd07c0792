"""The C decode MLP (``native.mlp_rows``) gives the MLP's values to bfloat16 rounding, row by row alone.

Its sums run in another order than oneDNN's and its activations are its own float32 approximations, so
outputs may differ from the oneDNN path in their last bfloat16 bits; the checks bound that against a
float32 reference. What must hold exactly: a row's output does not depend on the rows beside it, and
``GatedMLP`` takes the kernel for a decode step's few rows and oneDNN for more.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kvrelay.models.kernels.native.mlp_rows import MAX_ROWS, library, mlp_rows_native
from kvrelay.models.layers import Weights
from kvrelay.models.mlp import ACTIVATIONS, FEW_ROWS, GatedMLP

HIDDEN, INNER = 128, 320
needs_kernel = pytest.mark.skipif(
    library() is None, reason="the native kernel does not run here (no AVX-512 BF16 or no C compiler)"
)


def _weights(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    gate = (torch.randn(INNER, HIDDEN, generator=gen) / HIDDEN**0.5).bfloat16()
    up = (torch.randn(INNER, HIDDEN, generator=gen) / HIDDEN**0.5).bfloat16()
    down = (torch.randn(HIDDEN, INNER, generator=gen) / INNER**0.5).bfloat16()
    return gate, up, down


def _reference(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, name: str) -> torch.Tensor:
    """The MLP in float32 on the bfloat16 inputs, with the kernel's two roundings of the intermediate."""
    xf = x.float()
    act = ACTIVATIONS[name].fn(F.linear(xf, gate.float())).bfloat16().float()
    mid = (act * F.linear(xf, up.float())).bfloat16().float()
    return F.linear(mid, down.float())


@needs_kernel
@pytest.mark.parametrize("name", ["silu", "gelu_pytorch_tanh", "gelu"])
@pytest.mark.parametrize("rows", [1, 3, 8, MAX_ROWS])
def test_the_mlp_of_few_rows_matches_float32_to_bfloat16_rounding(name: str, rows: int) -> None:
    gate, up, down = _weights(seed=rows)
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(100 + rows)).bfloat16()
    got = mlp_rows_native(x, gate, up, down, ACTIVATIONS[name].native)
    assert got is not None and got.shape == (rows, HIDDEN) and got.dtype == torch.bfloat16
    want = _reference(x, gate, up, down, name)
    # the intermediate's roundings may differ by a bit where the approximations differ: a few bfloat16 ulps
    assert (got.float() - want).abs().max() <= 2e-2 * want.abs().max()


@needs_kernel
def test_each_row_gets_what_it_gets_alone() -> None:
    gate, up, down = _weights(seed=1)
    x = torch.randn(MAX_ROWS, HIDDEN, generator=torch.Generator().manual_seed(2)).bfloat16()
    together = mlp_rows_native(x, gate, up, down, "gelu_tanh")
    assert together is not None
    for m in range(MAX_ROWS):
        alone = mlp_rows_native(x[m : m + 1], gate, up, down, "gelu_tanh")
        assert alone is not None and torch.equal(together[m : m + 1], alone), f"row {m}"


@needs_kernel
def test_inputs_the_kernel_does_not_take_give_none() -> None:
    gate, up, down = _weights(seed=3)
    x = torch.randn(2, HIDDEN).bfloat16()
    assert mlp_rows_native(x[:0], gate, up, down, "silu") is None
    assert mlp_rows_native(torch.zeros(MAX_ROWS + 1, HIDDEN, dtype=torch.bfloat16), gate, up, down, "silu") is None
    assert mlp_rows_native(x.float(), gate, up, down, "silu") is None
    assert mlp_rows_native(x, gate, up, down, "relu") is None
    assert mlp_rows_native(x, gate, up, down.t(), "silu") is None  # not contiguous
    narrow = torch.zeros(INNER, 48, dtype=torch.bfloat16)
    assert (
        mlp_rows_native(torch.zeros(1, 48, dtype=torch.bfloat16), narrow, narrow, narrow.t().contiguous(), "silu")
        is None
    )


@needs_kernel
def test_gated_mlp_takes_the_kernel_for_few_rows_only() -> None:
    gate, up, down = _weights(seed=4)
    tensors = {
        "model.embed_tokens.weight": torch.zeros(4, HIDDEN),
        "model.layers.0.mlp.gate_proj.weight": gate,
        "model.layers.0.mlp.up_proj.weight": up,
        "model.layers.0.mlp.down_proj.weight": down,
    }
    config = SimpleNamespace(hidden_size=HIDDEN, intermediate_size=INNER, hidden_activation="gelu_pytorch_tanh")
    mlp = GatedMLP(Weights(tensors, torch.bfloat16, torch.device("cpu")), "model.layers.0.mlp", config)  # type: ignore[arg-type]
    x = torch.randn(FEW_ROWS + 1, HIDDEN, generator=torch.Generator().manual_seed(5)).bfloat16()
    few = mlp_rows_native(x[:FEW_ROWS], gate, up, down, "gelu_tanh")
    assert few is not None and torch.equal(mlp(x[:FEW_ROWS]), few)
    many = mlp(x)
    assert not torch.equal(many[:FEW_ROWS], few) or mlp.gate.packed is None  # oneDNN's sums, not the kernel's
    want = _reference(x, gate, up, down, "gelu_pytorch_tanh")
    assert (many.float() - want).abs().max() <= 2e-2 * want.abs().max()
