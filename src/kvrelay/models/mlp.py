"""The MLP block and the projections it is built of: ``PackedLinear`` and ``GatedMLP``.

``PackedLinear`` is ``F.linear`` with the CPU fast paths of bfloat16 (a oneDNN-packed
weight for up to ``PACKED_MAX_ROWS`` rows, the C GEMV of ``native.linear_row`` for a
single row; on CPUs without bfloat16 arithmetic, the AVX2 panels of
``native.linear_avx2``); ``GatedMLP`` is ``down(act(gate(x)) * up(x))``, whose activation
and product become oneDNN post-ops when the rows go through packed weights, and which takes a
decode step's few rows through one call of ``native.mlp_rows``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from kvrelay.models.config import ModelConfig
from kvrelay.models.kernels.native.build import best_isa
from kvrelay.models.kernels.native.linear_avx2 import Panels
from kvrelay.models.kernels.native.linear_row import linear_row_native
from kvrelay.models.kernels.native.mlp_rows import DecodeMLP

if TYPE_CHECKING:
    from kvrelay.models.weights import Weights


class Activation(NamedTuple):
    """An MLP activation: the function, the same function as oneDNN's post-op (attribute, algorithm), and its
    name in ``native.mlp_rows``."""

    fn: Callable[[torch.Tensor], torch.Tensor]
    onednn_attr: str
    onednn_algorithm: str
    native: str


ACTIVATIONS: dict[str, Activation] = {
    "silu": Activation(F.silu, "swish", "", "silu"),
    "gelu_pytorch_tanh": Activation(partial(F.gelu, approximate="tanh"), "gelu", "tanh", "gelu_tanh"),
    "gelu_new": Activation(partial(F.gelu, approximate="tanh"), "gelu", "tanh", "gelu_tanh"),
    "gelu": Activation(F.gelu, "gelu", "none", "gelu"),
}
"""The activations of ``config.json``'s ``hidden_act`` that kvrelay runs, by name."""


PACKED_MAX_ROWS = 256
"""Projections of at most this many rows use the packed weight; larger ones the plain one, which is
faster there for one projection (the figures behind the value: docs/performance.md, "Packed projections");
``GatedMLP``'s gate and up take any number of rows through the packed weights, for their post-ops."""


class PackedLinear:
    """``F.linear(x, weight, bias)``, with the weight also laid out once for oneDNN: bfloat16 on CPU.

    Given a plain weight, oneDNN's AMX / AVX-512 bf16 kernels re-lay it out on
    every call, which costs as much as the projection itself when few rows
    (decode) stream the weight from memory (docs/performance.md, "Packed
    projections"). The packed copy
    (``mkldnn._reorder_linear_weight``, what inductor's CPU freezing uses)
    takes the weight's size again in memory and gives the same values; it
    serves inputs of at most ``max_rows`` rows (``None``: all), the plain
    weight the rest (long prefill chunks, where re-laying out is amortized).
    Elsewhere (float32, CUDA, no mkldnn) this is plain ``F.linear``. A single bfloat16
    row without bias goes through ``native.linear_row`` where it is built. Where the
    kernels are the AVX2 ones (no bfloat16 arithmetic, so oneDNN has no bfloat16
    kernel) every bfloat16 input goes through the weight's ``native.linear_avx2.Panels``
    instead, which take as much memory again.
    """

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, max_rows: int | None = PACKED_MAX_ROWS
    ) -> None:
        self.weight = weight
        self.bias = bias
        self.max_rows = max_rows
        self.packed: torch.Tensor | None = None
        self.panels: Panels | None = None
        if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
            return
        if best_isa() == "avx2":
            self.panels = Panels.build(weight, bias)
        elif torch.backends.mkldnn.is_available():
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 32)
            except (AttributeError, NotImplementedError, RuntimeError):
                self.packed = None

    def packs(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes through the packed weight (else through ``F.linear``)."""
        rows = x.shape[0]
        return (
            self.packed is not None and rows > 0 and x.dim() == 2 and (self.max_rows is None or rows <= self.max_rows)
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            out = self.panels(x)
            if out is not None:
                return out
        if self.bias is None and x.dim() == 2 and x.shape[0] == 1:
            row = linear_row_native(x, self.weight)
            if row is not None:
                return row
        if not self.packs(x):
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")

    def packed_for(self, x: torch.Tensor) -> bool:
        """Whether ``activated`` and ``times`` take ``x``: a packed weight and 2-D rows, of any number."""
        return self.packed is not None and x.shape[0] > 0 and x.dim() == 2

    def activated(self, x: torch.Tensor, activation: Activation) -> torch.Tensor:
        """``activation(self(x))`` in one oneDNN call (the activation as a post-op); needs ``packed_for(x)``."""
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self.packed, self.bias, activation.onednn_attr, [], activation.onednn_algorithm
        )

    def times(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """``self(x) * other`` in one oneDNN call; needs ``packed_for(x)``."""
        return torch.ops.mkldnn._linear_pointwise.binary(x.contiguous(), other, self.packed, self.bias, "mul")


class GatedMLP:
    """``down(act(gate(x)) * up(x))``.

    Gate and up stay two projections: a fused one leaves both halves strided,
    and the activation and product on strided halves cost more on CPU than the
    fusion saves. Through packed weights the activation and the product are
    oneDNN post-ops of the gate and up projections (two calls instead of four).
    They apply to the float32 accumulator, so the gate's output is rounded to
    bfloat16 once instead of twice and the product once instead of three times
    (``tests/unit/test_packed_linear.py``). Gate and up take the post-ops for any
    number of rows, past ``PACKED_MAX_ROWS`` too (a long prefill chunk): the separate
    activation and product cost more than the plain weight's GEMM gains. A decode step's few
    bfloat16 rows (up to ``few_rows``) take the whole MLP in one C call with the same roundings
    (``native.mlp_rows.DecodeMLP``: one wake-up of the thread team, not three). (Why and how fast:
    docs/performance.md, "MLP gate and up" and "Decode MLP in one region".)
    """

    def __init__(self, w: Weights, prefix: str, config: ModelConfig) -> None:
        hidden, inner = config.hidden_size, config.intermediate_size
        if config.hidden_activation not in ACTIVATIONS:
            raise ValueError(
                f"activation '{config.hidden_activation}' is not supported; supported: {', '.join(ACTIVATIONS)}"
            )
        self.act = ACTIVATIONS[config.hidden_activation]
        self.gate = PackedLinear(w.take(f"{prefix}.gate_proj.weight", (inner, hidden)))
        self.up = PackedLinear(w.take(f"{prefix}.up_proj.weight", (inner, hidden)))
        self.down = PackedLinear(w.take(f"{prefix}.down_proj.weight", (hidden, inner)))
        self.decode: DecodeMLP | None = None
        """The decode kernel's view of the weights, where it runs (none with AVX2 panels)."""
        if all(p.panels is None and p.bias is None for p in (self.gate, self.up, self.down)):
            self.decode = DecodeMLP.build(self.gate.weight, self.up.weight, self.down.weight, self.act.native)
        self.few_rows = 0 if self.decode is None else self.decode.max_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.decode is not None and x.dim() == 2 and x.shape[0] <= self.few_rows:
            out = self.decode(x)
            if out is not None:
                return out
        if self.gate.packed_for(x) and self.up.packed_for(x):
            return self.down(self.up.times(x, self.gate.activated(x, self.act)))
        return self.down(self.act.fn(self.gate(x)).mul_(self.up(x)))
