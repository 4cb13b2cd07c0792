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
from kvrelay.models.kernels.native.mlp_rows import AMX_ROWS, AVX512_ROWS, DecodeMLP, LayerTail, amx_library, library
from kvrelay.models.layers import RMSNorm
from kvrelay.models.mlp import PackedLinear
from kvrelay.models.registry import build_model
from kvrelay.testing.tiny_models import make_tiny_model

HIDDEN, WIDTH, INNER, EPS = 128, 256, 320, 1e-6
ROWS = {True: AMX_ROWS, False: AVX512_ROWS}
"""The most rows each kernel's tail takes: AMX (True) or AVX-512 BF16 over the weights as they are (False)."""
pytestmark = pytest.mark.skipif(library() is None, reason="the decode kernels do not run here (no AVX-512 BF16)")


@pytest.fixture(
    params=[
        pytest.param(True, id="amx", marks=pytest.mark.skipif(amx_library() is None, reason="no AMX tiles")),
        pytest.param(False, id="avx512"),
    ]
)
def amx(request: pytest.FixtureRequest) -> bool:
    return request.param  # type: ignore[no-any-return]


def _parts(seed: int, gemma: bool, amx: bool) -> tuple[LayerTail, PackedLinear, DecodeMLP, tuple[RMSNorm | None, ...]]:
    gen = torch.Generator().manual_seed(seed)

    def weight(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=gen) / cols**0.5).bfloat16()

    def norm() -> RMSNorm:
        return RMSNorm((torch.randn(HIDDEN, generator=gen) * 0.1).bfloat16(), EPS, unit_offset=gemma)

    o = PackedLinear(weight(HIDDEN, WIDTH))
    mlp = DecodeMLP.build(weight(INNER, HIDDEN), weight(INNER, HIDDEN), weight(HIDDEN, INNER), "gelu_tanh", amx=amx)
    norms = (norm(), norm(), norm()) if gemma else (None, norm(), None)
    weights = tuple(None if n is None else n.kernel_weight for n in norms)
    assert mlp is not None and weights[1] is not None
    tail = LayerTail.build(o.weight, mlp, (weights[0], weights[1], weights[2]), EPS, unit_offset=gemma)
    assert tail is not None and tail.max_rows == ROWS[amx]
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
@pytest.mark.parametrize("rows", [1, 7, "most"])
def test_the_tail_gives_what_the_separate_calls_give(gemma: bool, rows: int | str, amx: bool) -> None:
    rows = ROWS[amx] if rows == "most" else int(rows)
    tail, o, mlp, norms = _parts(seed=rows, gemma=gemma, amx=amx)
    gen = torch.Generator().manual_seed(50 + rows)
    attn = torch.randn(rows, WIDTH, generator=gen).bfloat16()
    h = torch.randn(rows, HIDDEN, generator=gen).bfloat16()
    want = _separately(attn, h, o, mlp, norms).float()
    got = h.clone()
    assert tail(attn, got)
    assert (got.float() - want).abs().max() <= 2e-2 * want.abs().max()
    assert not torch.equal(got, h), "the tail works in place"


def test_each_row_gets_what_it_gets_alone(amx: bool) -> None:
    tail, *_ = _parts(seed=3, gemma=True, amx=amx)
    gen = torch.Generator().manual_seed(4)
    attn = torch.randn(ROWS[amx], WIDTH, generator=gen).bfloat16()
    h = torch.randn(ROWS[amx], HIDDEN, generator=gen).bfloat16()
    together = h.clone()
    assert tail(attn, together)
    for m in range(ROWS[amx]):
        alone = h[m : m + 1].clone()
        assert tail(attn[m : m + 1], alone) and torch.equal(alone, together[m : m + 1]), f"row {m}"


def test_rows_it_does_not_take_are_left_untouched(amx: bool) -> None:
    tail, *_ = _parts(seed=5, gemma=True, amx=amx)
    h = torch.randn(ROWS[amx] + 1, HIDDEN).bfloat16()
    before = h.clone()
    assert not tail(torch.randn(ROWS[amx] + 1, WIDTH).bfloat16(), h)  # more rows than the kernel takes
    assert not tail(torch.randn(2, WIDTH + 32).bfloat16(), h[:2])  # attention of another width
    assert not tail(torch.randn(2, WIDTH), h[:2])  # float32 attention
    assert torch.equal(h, before)
    assert LayerTail.build(torch.zeros(HIDDEN, WIDTH), tail.mlp, tail.norms, EPS, True) is None  # float32 weight


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_a_decode_step_of_a_model_takes_the_tails_and_keeps_its_logits(
    arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiny model in bfloat16: a decode step's logits through the tails (Gemma 3's linked, each computing the
    next layer's start) equal those of the separate calls to bfloat16 rounding, and every tail ran."""
    directory = make_tiny_model(arch, tmp_path / "model", seed=2)
    config = ModelConfig.from_hf(json.loads((directory / "config.json").read_text()))
    model = build_model(config, load_file(directory / "model.safetensors"), dtype=torch.bfloat16)
    layers: list = model.layers  # type: ignore[type-arg]
    assert all(layer.tail is not None for layer in layers)
    linked = [layer.next_rope is not None for layer in layers]
    assert linked == ([True] * (len(layers) - 1) + [False] if arch == "gemma3" else [False] * len(layers))
    kv = KVPages.allocate(config, 8, 16, dtype=torch.bfloat16)
    for i, prompt in enumerate([[5, 6, 7, 8, 9], [10, 11, 12]]):
        model.hidden(ForwardBatch.build([(prompt, 0, [2 * i, 2 * i + 1])]), kv)
    step = ForwardBatch.build([([13], 5, [0, 1]), ([14], 3, [2, 3])])
    runs: list[bool] = []
    run = LayerTail._run

    def counted(self: LayerTail, attn: torch.Tensor, h: torch.Tensor, head: object) -> torch.Tensor | None:
        runs.append(head is not None)
        return run(self, attn, h, head)  # type: ignore[arg-type]

    monkeypatch.setattr(LayerTail, "_run", counted)
    with_tails = model.logits(model.hidden(step, kv)).float()
    assert runs == linked
    for layer in layers:
        layer.tail, layer.next_rope = None, None
    without = model.logits(model.hidden(step, kv)).float()
    assert (with_tails - without).abs().max() <= 5e-2 * without.abs().max()


def test_the_next_layers_start_equals_what_its_attention_computes(tmp_path: Path) -> None:
    """``through_next``'s q, k, v rows equal the next layer's own input norm, projection, q and k norms and rope
    on the updated ``h``, to bfloat16 rounding (the projection's sums may run in another order)."""
    directory = make_tiny_model("gemma3", tmp_path / "model", seed=3)
    config = ModelConfig.from_hf(json.loads((directory / "config.json").read_text()))
    model = build_model(config, load_file(directory / "model.safetensors"), dtype=torch.bfloat16)
    first, second = model.layers[0], model.layers[1]  # type: ignore[attr-defined]
    attention = second.attention
    gen = torch.Generator().manual_seed(6)
    rows = 5
    attn = torch.randn(rows, first.tail.width, generator=gen).bfloat16()
    h = torch.randn(rows, config.hidden_size, generator=gen).bfloat16()
    positions = torch.arange(rows) * 7
    assert first.next_rope == attention.layer_type
    cos, sin = model.rotaries[attention.layer_type].cos_sin(positions, torch.bfloat16)
    fused_h = h.clone()
    start = first.tail.through_next(attn, fused_h, cos, sin)
    assert start is not None
    plain_h = h.clone()
    assert first.tail(attn, plain_h) and torch.equal(fused_h, plain_h)
    qkv = attention.qkv(second.input_norm(plain_h))
    width = (attention.heads + attention.kv_heads) * attention.head_dim
    qk = attention.qk_norm.then_rope(qkv[:, :width].view(rows, -1, attention.head_dim), cos, sin).reshape(rows, -1)
    want = torch.cat((qk, qkv[:, width:]), dim=1).float()
    assert (start.float() - want).abs().max() <= 2e-2 * want.abs().max()
