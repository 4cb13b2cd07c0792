"""A layer's work after its attention in one kernel call (``LayerTail``) gives what the separate calls give.

The separate calls are the model's own path for rows the tail does not take: the output projection, the
norms with their residual adds (``RMSNorm``) and the MLP. The tail rounds each step as they do; its
projection sums may run in another order than oneDNN's, so values are compared to bfloat16 rounding, and a
row's result must not depend on the rows beside it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvrelay.models.batch import ForwardBatch
from kvrelay.models.config import ModelConfig
from kvrelay.models.kernels.kv_pages import KVPages
from kvrelay.models.kernels.native.mlp_rows import AMX_ROWS, DecodeMLP, LayerTail, amx_library
from kvrelay.models.layers import RMSNorm
from kvrelay.models.mlp import PackedLinear
from kvrelay.models.registry import build_model
from kvrelay.testing.tiny_models import make_tiny_model

HIDDEN, WIDTH, INNER, EPS = 128, 256, 320, 1e-6
pytestmark = pytest.mark.skipif(amx_library() is None, reason="the AMX kernel does not run here (no AMX tiles)")


def _parts(seed: int, gemma: bool) -> tuple[LayerTail, PackedLinear, DecodeMLP, tuple[RMSNorm | None, ...]]:
    gen = torch.Generator().manual_seed(seed)

    def weight(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=gen) / cols**0.5).bfloat16()

    def norm() -> RMSNorm:
        return RMSNorm((torch.randn(HIDDEN, generator=gen) * 0.1).bfloat16(), EPS, unit_offset=gemma)

    o = PackedLinear(weight(HIDDEN, WIDTH))
    mlp = DecodeMLP.build(weight(INNER, HIDDEN), weight(INNER, HIDDEN), weight(HIDDEN, INNER), "gelu_tanh")
    norms = (norm(), norm(), norm()) if gemma else (None, norm(), None)
    weights = tuple(None if n is None else n.kernel_weight for n in norms)
    assert mlp is not None and weights[1] is not None
    tail = LayerTail.build(o.weight, mlp, (weights[0], weights[1], weights[2]), EPS, unit_offset=gemma)
    assert tail is not None
    return tail, o, mlp, norms


def _separately(
    attn: torch.Tensor, h: torch.Tensor, o: PackedLinear, mlp: DecodeMLP, norms: tuple[RMSNorm | None, ...]
) -> torch.Tensor:
    post_attn, pre_ff, post_ff = norms
    assert pre_ff is not None
    h = h.clone()
    projected = o(attn)
    h = h.add_(projected) if post_attn is None else post_attn.add_to(h, projected)
    out = mlp(pre_ff(h))
    assert out is not None
    return h.add_(out) if post_ff is None else post_ff.add_to(h, out)


@pytest.mark.parametrize("gemma", [True, False], ids=["gemma", "llama"])
@pytest.mark.parametrize("rows", [1, 7, AMX_ROWS])
def test_the_tail_gives_what_the_separate_calls_give(gemma: bool, rows: int) -> None:
    tail, o, mlp, norms = _parts(seed=rows, gemma=gemma)
    gen = torch.Generator().manual_seed(50 + rows)
    attn = torch.randn(rows, WIDTH, generator=gen).bfloat16()
    h = torch.randn(rows, HIDDEN, generator=gen).bfloat16()
    want = _separately(attn, h, o, mlp, norms).float()
    got = h.clone()
    assert tail(attn, got)
    assert (got.float() - want).abs().max() <= 2e-2 * want.abs().max()
    assert not torch.equal(got, h), "the tail works in place"


def test_each_row_gets_what_it_gets_alone() -> None:
    tail, *_ = _parts(seed=3, gemma=True)
    gen = torch.Generator().manual_seed(4)
    attn = torch.randn(AMX_ROWS, WIDTH, generator=gen).bfloat16()
    h = torch.randn(AMX_ROWS, HIDDEN, generator=gen).bfloat16()
    together = h.clone()
    assert tail(attn, together)
    for m in range(AMX_ROWS):
        alone = h[m : m + 1].clone()
        assert tail(attn[m : m + 1], alone) and torch.equal(alone, together[m : m + 1]), f"row {m}"


def test_rows_it_does_not_take_are_left_untouched() -> None:
    tail, *_ = _parts(seed=5, gemma=True)
    h = torch.randn(AMX_ROWS + 1, HIDDEN).bfloat16()
    before = h.clone()
    assert not tail(torch.randn(AMX_ROWS + 1, WIDTH).bfloat16(), h)  # more rows than the kernel takes
    assert not tail(torch.randn(2, WIDTH + 32).bfloat16(), h[:2])  # attention of another width
    assert not tail(torch.randn(2, WIDTH), h[:2])  # float32 attention
    assert torch.equal(h, before)
    assert LayerTail.build(torch.zeros(HIDDEN, WIDTH), tail.mlp, tail.norms, EPS, True) is None  # float32 weight


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_a_decode_step_of_a_model_takes_the_tail_and_keeps_its_logits(arch: str, tmp_path: Path) -> None:
    """A tiny model in bfloat16: a decode step's logits with the tails equal those of the separate calls to
    bfloat16 rounding, and every layer's tail ran."""
    directory = make_tiny_model(arch, tmp_path / "model", seed=2)
    config = ModelConfig.from_hf(json.loads((directory / "config.json").read_text()))
    model = build_model(config, load_file(directory / "model.safetensors"), dtype=torch.bfloat16)
    tails = [layer.tail for layer in model.layers]  # type: ignore[attr-defined]
    assert all(t is not None for t in tails)
    kv = KVPages.allocate(config, 8, 16, dtype=torch.bfloat16)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    for i, p in enumerate(prompts):
        model.hidden(ForwardBatch.build([(p, 0, [2 * i, 2 * i + 1])]), kv)
    step = ForwardBatch.build([([13], 5, [0, 1]), ([14], 3, [2, 3])])
    calls = []
    for layer, tail in zip(model.layers, tails, strict=True):
        layer.tail = lambda a, h, tail=tail: calls.append(1) or tail(a, h)  # type: ignore[attr-defined]
    with_tails = model.logits(model.hidden(step, kv)).float()
    for layer in model.layers:
        layer.tail = None  # type: ignore[attr-defined]
    without = model.logits(model.hidden(step, kv)).float()
    assert len(calls) == len(tails)
    assert (with_tails - without).abs().max() <= 5e-2 * without.abs().max()
