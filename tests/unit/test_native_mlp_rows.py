"""The C decode MLPs (``native.mlp_rows``) give the MLP's values to bfloat16 rounding, row by row alone.

Their sums run in another order than oneDNN's and their activations are their own float32 approximations, so
outputs may differ from the oneDNN path in their last bfloat16 bits; the checks bound that against a
float32 reference. What must hold exactly: a row's output does not depend on the rows beside it, and
``GatedMLP`` takes the kernel for a decode step's few rows and oneDNN for more. Both kernels are checked
where they run: the AVX-512 one (``vdpbf16ps``) and the AMX one (bfloat16 tiles over a tile-order copy).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kvrelay.models.kernels.native.mlp_rows import (
    AMX_ROWS,
    AVX512_ROWS,
    DecodeMLP,
    amx_library,
    library,
)
from kvrelay.models.layers import Weights
from kvrelay.models.mlp import ACTIVATIONS, GatedMLP

HIDDEN, INNER = 128, 320
needs_kernel = pytest.mark.skipif(
    library() is None, reason="the native kernel does not run here (no AVX-512 BF16 or no C compiler)"
)


def mlp_rows_native(
    x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, activation: str
) -> torch.Tensor | None:
    """The AVX-512 kernel's MLP of ``x``, built for one call."""
    mlp = DecodeMLP.build(gate, up, down, activation, amx=False)
    return None if mlp is None else mlp(x)


needs_amx = pytest.mark.skipif(amx_library() is None, reason="the AMX kernel does not run here (no AMX tiles)")
KERNELS = [
    pytest.param(False, AVX512_ROWS, marks=needs_kernel, id="avx512"),
    pytest.param(True, AMX_ROWS, marks=needs_amx, id="amx"),
]


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


@pytest.mark.parametrize(("amx", "most"), KERNELS)
@pytest.mark.parametrize("name", ["silu", "gelu_pytorch_tanh", "gelu"])
def test_the_mlp_of_few_rows_matches_float32_to_bfloat16_rounding(amx: bool, most: int, name: str) -> None:
    gate, up, down = _weights(seed=most)
    mlp = DecodeMLP.build(gate, up, down, ACTIVATIONS[name].native, amx=amx)
    assert mlp is not None and mlp.max_rows == most
    for rows in sorted({1, 3, min(most, 16), most - 1, most}):
        x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(100 + rows)).bfloat16()
        got = mlp(x)
        assert got is not None and got.shape == (rows, HIDDEN) and got.dtype == torch.bfloat16
        want = _reference(x, gate, up, down, name)
        # the intermediate's roundings may differ by a bit where the approximations differ: a few bfloat16 ulps
        assert (got.float() - want).abs().max() <= 2e-2 * want.abs().max(), f"{rows} rows"


@pytest.mark.parametrize(("amx", "most"), KERNELS)
def test_each_row_gets_what_it_gets_alone(amx: bool, most: int) -> None:
    gate, up, down = _weights(seed=1)
    mlp = DecodeMLP.build(gate, up, down, "gelu_tanh", amx=amx)
    x = torch.randn(most, HIDDEN, generator=torch.Generator().manual_seed(2)).bfloat16()
    assert mlp is not None
    together = mlp(x)
    assert together is not None
    for m in range(most):
        alone = mlp(x[m : m + 1])
        assert alone is not None and torch.equal(together[m : m + 1], alone), f"row {m}"


@needs_kernel
def test_inputs_the_kernel_does_not_take_give_none() -> None:
    gate, up, down = _weights(seed=3)
    x = torch.randn(2, HIDDEN).bfloat16()
    assert mlp_rows_native(x[:0], gate, up, down, "silu") is None
    assert mlp_rows_native(torch.zeros(AVX512_ROWS + 1, HIDDEN, dtype=torch.bfloat16), gate, up, down, "silu") is None
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
    assert mlp.decode is not None and mlp.few_rows == mlp.decode.max_rows
    most = mlp.few_rows
    x = torch.randn(most + 1, HIDDEN, generator=torch.Generator().manual_seed(5)).bfloat16()
    few = mlp.decode(x[:most])
    assert few is not None and torch.equal(mlp(x[:most]), few)
    many = mlp(x)
    assert not torch.equal(many[:most], few) or mlp.gate.packed is None  # oneDNN's sums, not the kernel's
    want = _reference(x, gate, up, down, "gelu_pytorch_tanh")
    assert (many.float() - want).abs().max() <= 2e-2 * want.abs().max()
