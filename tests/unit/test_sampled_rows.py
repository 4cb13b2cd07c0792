"""A prefill-only forward finishes its last layer for the sampled rows alone (``models.sampled_rows``).

Real tiny models (Gemma 3 with a full or a sliding last layer, Llama), float32 and bfloat16: the same forward
with the last layer over every row (``sampled_rows`` off) writes the same keys and values, gives the same logits
to rounding, and its last MLP sees every row where the sampled path's sees one per sampled sequence.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import kvrelay.models.layers as layers
from kvrelay.models.batch import ForwardBatch
from kvrelay.models.config import ModelConfig
from kvrelay.models.kernels.kv_pages import KVPages
from kvrelay.models.layers import PagedModel
from kvrelay.models.registry import build_model
from kvrelay.models.sampled_rows import sampled_rows
from kvrelay.testing.tiny_models import make_tiny_model
from tests.support.torch_threads import one_thread  # noqa: F401  (autouse: torch on one thread)

PAGE = 8
PAGES_EACH = 8


@pytest.fixture(
    scope="module",
    params=[("gemma3", {}), ("gemma3", {"num_hidden_layers": 5}), ("llama", {})],
    ids=["gemma3-full-last", "gemma3-sliding-last", "llama"],
)
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch, overrides = request.param
    return make_tiny_model(arch, tmp_path_factory.mktemp(arch), seed=3, **overrides)


def load(directory: Path, dtype: torch.dtype) -> PagedModel:
    config = ModelConfig.from_hf(json.loads((directory / "config.json").read_text()))
    return build_model(config, {k: v.to(dtype) for k, v in load_file(directory / "model.safetensors").items()})


class RowSpy:
    """Wraps a layer's MLP and records how many rows each call got."""

    def __init__(self, mlp: Any) -> None:
        self.mlp = mlp
        self.rows: list[int] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.rows.append(x.shape[0])
        return self.mlp(x)


def prefill(
    model: PagedModel, batch: ForwardBatch, sampled: bool, monkeypatch: pytest.MonkeyPatch
) -> tuple[torch.Tensor, KVPages, list[int]]:
    kv = KVPages.allocate(model.config, PAGES_EACH * batch.num_seqs, PAGE, dtype=model.dtype)
    spy = RowSpy(model.layers[-1].mlp)
    with monkeypatch.context() as patch:
        patch.setattr(model.layers[-1], "mlp", spy)
        if not sampled:
            patch.setattr(layers, "sampled_rows", lambda *args, **kwargs: None)
        logits = model.forward(batch, kv)
    return logits, kv, spy.rows


def chunks(vocab: int, lens: list[int], starts: list[int]) -> ForwardBatch:
    gen = torch.Generator().manual_seed(5)
    tables = [list(range(i * PAGES_EACH, (i + 1) * PAGES_EACH)) for i in range(len(lens))]
    tokens = [torch.randint(4, vocab, (n,), generator=gen).tolist() for n in lens]
    return ForwardBatch.build(list(zip(tokens, starts, tables, strict=True)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_last_layer_finishes_only_the_sampled_rows_with_the_same_keys_values_and_logits(
    model_dir: Path, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = load(model_dir, dtype)
    batch = chunks(model.config.vocab_size, [37, 20, 9], [0, 0, 0])  # past the tiny Gemma's 16-token window
    logits, kv, rows = prefill(model, batch, sampled=True, monkeypatch=monkeypatch)
    every_logits, every_kv, every_rows = prefill(model, batch, sampled=False, monkeypatch=monkeypatch)
    assert rows == [3] and every_rows == [66]
    assert torch.equal(kv.k, every_kv.k) and torch.equal(kv.v, every_kv.v)
    tolerance = 1e-5 if dtype == torch.float32 else 0.06
    torch.testing.assert_close(logits, every_logits, atol=tolerance, rtol=0)
    assert torch.equal(logits.argmax(-1), every_logits.argmax(-1))


def test_a_chunk_that_does_not_end_its_prompt_writes_its_keys_and_values_and_finishes_no_row(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = load(model_dir, torch.float32)
    batch = chunks(model.config.vocab_size, [24, 16], [0, 0])
    batch = replace(batch, logits_indices=torch.arange(0))
    hidden_rows, kv, rows = prefill(model, batch, sampled=True, monkeypatch=monkeypatch)
    _, every_kv, every_rows = prefill(model, batch, sampled=False, monkeypatch=monkeypatch)
    assert hidden_rows.shape[0] == 0
    assert rows == [] and every_rows == [40]
    assert torch.equal(kv.k, every_kv.k) and torch.equal(kv.v, every_kv.v)


def plan(batch: ForwardBatch) -> Any:
    return sampled_rows(batch, PAGE, 16, torch.device("cpu"), torch.float32, layer=5)


def test_sampled_rows_follow_the_logits_order_and_stand_aside_for_decode_rows_and_inner_rows() -> None:
    batch = chunks(100, [5, 7, 3], [0, 10, 0])
    reordered = replace(batch, logits_indices=torch.tensor([14, 4]))
    sampled = plan(reordered)
    assert sampled is not None and sampled.layer == 5 and sampled.rows.tolist() == [14, 4]
    assert sampled.plan is not None and sampled.plan.num_tokens == 2
    assert [g.queries_per_seq for g in sampled.plan.full] == [1]

    decoding = chunks(100, [5, 1], [0, 20])
    assert plan(decoding) is None, "a decode row keeps its every-step path"
    inner = replace(batch, logits_indices=torch.tensor([3, 4]))
    assert plan(inner) is None, "row 3 is not the last of its sequence"
