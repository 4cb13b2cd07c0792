"""The C decode-attention kernel gives what the PyTorch path gives, and is skipped wherever it does not apply.

The kernel sums in another order than oneDNN, so an output may differ from
``decode_attention`` in its last bfloat16 bit; the checks allow that and no more
(at most 2 bfloat16 units in the last place of the output's scale, and nearly all
outputs identical). A tiny Gemma 3 with Gemma 3 270M's head shape (4 query heads per
KV head, head dim 256) decodes with the kernel in its rings and full layers, and its
logits match the same model decoding through PyTorch.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import kvrelay.models.kernels.native.attention as native
from kvrelay.models.batch import ForwardBatch, LaneRef
from kvrelay.models.config import ModelConfig
from kvrelay.models.kernels import attention, window_mirror
from kvrelay.models.kernels.attention import decode_attention
from kvrelay.models.kernels.kv_pages import KVPages
from kvrelay.models.kernels.native import build
from kvrelay.models.kernels.native.attention import decode_attention_native
from kvrelay.models.registry import build_model
from kvrelay.testing.tiny_models import make_tiny_model
from tests.support.bench_smoke import run_bench
from tests.support.bf16_close import assert_last_bit_close

needs_kernel = pytest.mark.skipif(
    build.load_best("decode_attention", native._SIGNATURES) is None,
    reason="the native kernel does not run here (no AVX2 or no C compiler)",
)


def inputs(
    batch: int, kv_heads: int, group: int, keys: int, dim: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, kv_heads, group, dim, generator=gen).bfloat16()
    k = torch.randn(batch, kv_heads, keys, dim, generator=gen).bfloat16()
    v = torch.randn(batch, kv_heads, keys, dim, generator=gen).bfloat16()
    visible = torch.randint(1, keys + 1, (batch,), generator=gen)
    visible[0], visible[-1] = 1, keys
    return q, k, v, visible


def prefix_mask(visible: torch.Tensor, keys: int) -> torch.Tensor:
    hidden = torch.arange(keys) >= visible.view(-1, 1, 1, 1)
    return torch.zeros(hidden.shape, dtype=torch.bfloat16).masked_fill_(hidden, float("-inf"))


@needs_kernel
@pytest.mark.parametrize(
    ("batch", "kv_heads", "group", "keys", "dim"),
    [(7, 1, 4, 512, 256), (5, 2, 4, 67, 128), (3, 1, 8, 33, 256), (4, 2, 16, 130, 128)],
)
def test_kernel_matches_decode_attention(batch: int, kv_heads: int, group: int, keys: int, dim: int, isa: str) -> None:
    q, k, v, visible = inputs(batch, kv_heads, group, keys, dim, seed=keys)
    got = decode_attention_native(q, k, v, visible, dim**-0.5)
    assert got is not None and got.shape == q.shape
    assert_last_bit_close(got, decode_attention(q, k, v, prefix_mask(visible, keys), dim**-0.5), units=2)


@needs_kernel
def test_strided_keys_give_the_contiguous_result(isa: str) -> None:
    """Gathered pages are ``[B, S, kv_heads, D]`` seen as ``[B, kv_heads, S, D]``: the kernel reads them in place."""
    q, k, v, visible = inputs(4, 2, 4, 48, 128, seed=3)
    k_strided = k.transpose(1, 2).contiguous().transpose(1, 2)
    v_strided = v.transpose(1, 2).contiguous().transpose(1, 2)
    assert not k_strided.is_contiguous()
    strided = decode_attention_native(q, k_strided, v_strided, visible, 0.1)
    contiguous = decode_attention_native(q, k, v, visible, 0.1)
    assert strided is not None and contiguous is not None
    assert torch.equal(strided, contiguous)


@needs_kernel
def test_hidden_keys_do_not_matter(isa: str) -> None:
    q, k, v, visible = inputs(3, 1, 4, 40, 128, seed=4)
    before = decode_attention_native(q, k, v, visible, 0.1)
    for b, n in enumerate(visible.tolist()):
        k[b, :, n:] = torch.nan
        v[b, :, n:] = 1e4
    after = decode_attention_native(q, k, v, visible, 0.1)
    assert before is not None and after is not None
    assert torch.equal(before, after)


@needs_kernel
@pytest.mark.parametrize("count", [0, 49])
def test_visible_counts_outside_the_keys_are_refused(count: int, isa: str) -> None:
    q, k, v, visible = inputs(2, 1, 4, 48, 128, seed=5)
    visible[1] = count
    with pytest.raises(ValueError, match=r"each visible count must be in 1\.\.48"):
        decode_attention_native(q, k, v, visible, 0.1)


@pytest.mark.parametrize(
    "change",
    ["float32", "group of 2", "head dim 64", "values strided unlike keys", "on the wrong batch"],
)
def test_shapes_the_kernel_does_not_take_fall_back(change: str) -> None:
    q, k, v, visible = inputs(2, 1, 4, 32, 128, seed=6)
    if change == "float32":
        q, k, v = q.float(), k.float(), v.float()
    elif change == "group of 2":
        q = q[:, :, :2]
    elif change == "head dim 64":
        q, k, v = q[..., :64], k[..., :64].contiguous(), v[..., :64].contiguous()
    elif change == "values strided unlike keys":
        v = torch.empty(2, 32, 2, 128, dtype=torch.bfloat16)[:, :, :1].transpose(1, 2)
    else:
        visible = visible[:1]
    assert decode_attention_native(q, k, v, visible, 0.1) is None


@pytest.mark.parametrize("setting", ["turned off", "no compiler", "compiler fails"])
def test_without_a_build_the_pytorch_path_serves(
    setting: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path))
    if setting == "turned off":
        monkeypatch.setenv(build.DISABLE_ENV, "0")
    elif setting == "no compiler":
        monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    else:
        monkeypatch.setenv("CC", "false")
    monkeypatch.setattr(build, "cpu_supports", lambda isa="avx512": True)
    build.clear_caches()
    try:
        with caplog.at_level(logging.WARNING, logger=build.__name__):
            q, k, v, visible = inputs(2, 1, 4, 32, 128, seed=7)
            assert decode_attention_native(q, k, v, visible, 0.1) is None
    finally:
        build.clear_caches()
    expected = {"turned off": None, "no compiler": "no C compiler", "compiler fails": "failed on"}[setting]
    if expected is None:
        assert not caplog.records
    else:
        assert expected in caplog.text
    assert not list(tmp_path.glob("native/*.so"))


@needs_kernel
def test_a_model_decodes_through_the_kernel_as_through_pytorch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, isa: str
) -> None:
    directory = make_tiny_model("gemma3", tmp_path, seed=11, head_dim=256, num_attention_heads=4, num_key_value_heads=1)
    config = ModelConfig.from_hf(json.loads((directory / "config.json").read_text()))
    weights = load_file(directory / "model.safetensors")
    models = [build_model(config, weights, dtype=torch.bfloat16) for _ in range(2)]
    pools = [KVPages.allocate(config, 40, 4, dtype=torch.bfloat16) for _ in range(2)]
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(4, config.vocab_size, (n,), generator=gen).tolist() for n in (5, 23, 40)]
    tables = [list(range(i * 13, i * 13 + 13)) for i in range(3)]
    lanes = [LaneRef(slot, owner) for slot, owner in ((2, 1), (0, 2), (1, 3))]
    calls = []

    def counted(*args: object) -> torch.Tensor | None:
        out = decode_attention_native(*args)  # type: ignore[arg-type]
        calls.append(out is not None)
        return out

    def run(model_index: int, batch: ForwardBatch, native_on: bool) -> torch.Tensor:
        with monkeypatch.context() as patch:
            replacement = counted if native_on else (lambda *args: None)
            patch.setattr(window_mirror, "decode_attention_native", replacement)
            patch.setattr(attention, "decode_attention_native", replacement)
            return models[model_index].forward(batch, pools[model_index])

    prefill = ForwardBatch.build([(p, 0, t) for p, t in zip(prompts, tables, strict=True)], lanes=lanes)
    tokens = run(0, prefill, True).argmax(-1).tolist()
    run(1, prefill, False)
    lengths = [len(p) for p in prompts]
    for _ in range(6):
        batch = ForwardBatch.build(
            [([t], n, table) for t, n, table in zip(tokens, lengths, tables, strict=True)], lanes=lanes
        )
        with_kernel, without = run(0, batch, True), run(1, batch, False)
        torch.testing.assert_close(with_kernel, without, rtol=0, atol=0.02 * without.abs().max().item())
        tokens, lengths = without.argmax(-1).tolist(), [n + 1 for n in lengths]
    assert calls and all(calls), "decode steps should have run the kernel in rings and full layers"


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_bfloat16_model_builds_every_kernel_before_its_first_forward(
    dtype: torch.dtype, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, isa: str
) -> None:
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path / "cache"))
    directory = make_tiny_model("gemma3", tmp_path / "model", seed=1)
    config = ModelConfig.from_hf(json.loads((directory / "config.json").read_text()))
    build.clear_caches()
    try:
        build_model(config, load_file(directory / "model.safetensors"), dtype=dtype)
        built = sorted(path.name.split("-")[0] for path in (tmp_path / "cache").glob("native/*.so"))
    finally:
        build.clear_caches()
    kernels = {
        "avx512": [
            "decode_attention",
            "head_screen",
            *(["head_screen_amx"] * build.cpu_supports("amx")),
            "linear_row",
            "mlp_rows",
            *(["mlp_rows_amx"] * build.cpu_supports("amx")),
            *(["prefill_attention_amx"] * build.cpu_supports("amx")),
            "prefill_attention_avx512",
            "rms_norm",
        ],
        "avx2": ["decode_attention_avx2", "head_screen_avx2", "linear_avx2", "rms_norm_avx2"],
    }
    assert built == (kernels[isa] if dtype == torch.bfloat16 else [])


@needs_kernel
def test_ring_attention_bench_smoke(tmp_path: Path) -> None:
    """bench/ring_attention.py runs on 2 lanes and writes every figure (values not asserted)."""
    code, figures = run_bench(
        "ring_attention.py", ["--lanes", "2", "--repeats", "1", "--threads", "1"], tmp_path / "figures.json"
    )
    assert code == 0
    assert {f["name"] for f in figures} >= {"rings_speedup_median", "full_speedup_median"}
    assert all(set(f) == {"name", "value", "unit", "baseline", "baseline_value"} for f in figures)
