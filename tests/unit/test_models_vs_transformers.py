"""The paged adapters reproduce transformers' logits on the same tiny random weights (float32).

Each architecture's tiny model is written as a real artifact (config.json +
model.safetensors) and read back twice: by transformers (the reference, full
sequences, no cache) and by ``build_model``. Pages are handed out in a shuffled
order so no test passes by contiguity. Error bound: max abs difference under
1e-4 of the reference logits' scale.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from kvrelay.models.batch import ForwardBatch
from kvrelay.models.config import ModelConfig, UnsupportedModelError
from kvrelay.models.kernels.kv_pages import KVPages
from kvrelay.models.layers import PagedModel
from kvrelay.models.registry import build_model
from kvrelay.testing.tiny_models import TINY_ARCHITECTURES, make_tiny_model
from tests.support.torch_threads import one_thread  # noqa: F401  (autouse: torch on one thread)

PAGE = 8
TOLERANCE = 1e-4


@dataclass
class Pair:
    config: ModelConfig
    ours: PagedModel
    reference: torch.nn.Module
    weights: dict[str, torch.Tensor]

    def reference_logits(self, tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.reference(torch.tensor([tokens])).logits[0].float()


class PageAllocator:
    """Hands out page ids of a pool in a fixed shuffled order."""

    def __init__(self, num_pages: int, seed: int = 0) -> None:
        self.free = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()

    def take(self, n: int) -> list[int]:
        pages, self.free = self.free[:n], self.free[n:]
        return pages


def load_pair(directory: Path) -> Pair:
    config = ModelConfig.from_hf(json.loads((directory / "config.json").read_text()))
    weights = load_file(directory / "model.safetensors")
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return Pair(config, build_model(config, weights), reference, weights)


@pytest.fixture(scope="module", params=TINY_ARCHITECTURES)
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    return load_pair(make_tiny_model(request.param, tmp_path_factory.mktemp(request.param), seed=3))


def tokens_for(config: ModelConfig, n: int, seed: int) -> list[int]:
    return torch.randint(4, config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    scale = max(1.0, float(ref.abs().max()))
    err = float((ours - ref).abs().max())
    assert err < TOLERANCE * scale, f"max abs error {err:.3g} exceeds {TOLERANCE} x logit scale {scale:.3g}"


def pages_for(tokens: int) -> int:
    return (tokens + PAGE - 1) // PAGE


def test_prefill_logits_match(pair: Pair) -> None:
    tokens = tokens_for(pair.config, 45, seed=1)
    kv = KVPages.allocate(pair.config, 64, PAGE)
    table = PageAllocator(64).take(pages_for(45))
    logits = pair.ours.forward(ForwardBatch.build([(tokens, 0, table)], logits="all"), kv)
    assert logits.shape == (45, pair.config.vocab_size) and logits.dtype == torch.float32
    assert_close(logits, pair.reference_logits(tokens))


def test_decode_after_prefix_matches(pair: Pair) -> None:
    tokens = tokens_for(pair.config, 44, seed=2)
    ref = pair.reference_logits(tokens)
    kv = KVPages.allocate(pair.config, 64, PAGE)
    table = PageAllocator(64, seed=1).take(pages_for(44))
    pair.ours.forward(ForwardBatch.build([(tokens[:37], 0, table)]), kv)
    for pos in range(37, 44):
        logits = pair.ours.forward(ForwardBatch.build([([tokens[pos]], pos, table)]), kv)
        assert_close(logits[0], ref[pos])


def test_continuation_reads_pages_written_by_another_sequence(pair: Pair) -> None:
    """B shares A's first four full pages and computes only its own suffix."""
    first = tokens_for(pair.config, 40, seed=3)
    second = first[:32] + tokens_for(pair.config, 19, seed=4)
    kv = KVPages.allocate(pair.config, 64, PAGE)
    pages = PageAllocator(64, seed=2)
    table_a = pages.take(pages_for(40))
    pair.ours.forward(ForwardBatch.build([(first, 0, table_a)]), kv)
    table_b = table_a[:4] + pages.take(pages_for(51) - 4)
    chunk = pair.ours.forward(ForwardBatch.build([(second[32:45], 32, table_b)], logits="all"), kv)
    step = pair.ours.forward(ForwardBatch.build([(second[45:], 45, table_b)], logits="all"), kv)
    ref = pair.reference_logits(second)
    assert_close(chunk, ref[32:45])
    assert_close(step, ref[45:])


def test_sequences_longer_than_the_sliding_window_match(pair: Pair) -> None:
    """Chunked prefill then decode, far past the window of the Gemma 3 tiny model (16 tokens)."""
    n = 75
    tokens = tokens_for(pair.config, n, seed=5)
    ref = pair.reference_logits(tokens)
    kv = KVPages.allocate(pair.config, 64, PAGE)
    table = PageAllocator(64, seed=3).take(pages_for(n))
    got = [pair.ours.forward(ForwardBatch.build([(tokens[:37], 0, table)], logits="all"), kv)]
    got.append(pair.ours.forward(ForwardBatch.build([(tokens[37:61], 37, table)], logits="all"), kv))
    for pos in range(61, n):
        got.append(pair.ours.forward(ForwardBatch.build([([tokens[pos]], pos, table)]), kv))
    assert_close(torch.cat(got), ref)


def test_mixed_batch_of_prefills_and_decodes_matches(pair: Pair) -> None:
    """One step holding a decode, a fresh prefill, a prefill continuation and a second decode."""
    kv = KVPages.allocate(pair.config, 96, PAGE)
    pages = PageAllocator(96, seed=4)
    seqs = [tokens_for(pair.config, n, seed=10 + n) for n in (30, 21, 70, 58)]
    tables = [pages.take(pages_for(len(s))) for s in seqs]
    setup = [(seqs[0][:29], 0, tables[0]), (seqs[2][:40], 0, tables[2]), (seqs[3][:57], 0, tables[3])]
    pair.ours.forward(ForwardBatch.build(setup), kv)
    step = [
        (seqs[0][29:], 29, tables[0]),
        (seqs[1], 0, tables[1]),
        (seqs[2][40:], 40, tables[2]),
        (seqs[3][57:], 57, tables[3]),
    ]
    logits = pair.ours.forward(ForwardBatch.build(step, logits="all"), kv)
    rows = torch.tensor([1, 21, 30, 1]).cumsum(0)
    expected = [
        pair.reference_logits(seqs[0])[29:],
        pair.reference_logits(seqs[1]),
        pair.reference_logits(seqs[2])[40:],
        pair.reference_logits(seqs[3])[57:],
    ]
    for got, want in zip(torch.tensor_split(logits, rows[:-1].tolist()), expected, strict=True):
        assert_close(got, want)


def test_bfloat16_stays_near_the_float32_reference(pair: Pair) -> None:
    model = build_model(pair.config, pair.weights, dtype=torch.bfloat16)
    tokens = tokens_for(pair.config, 40, seed=6)
    kv = KVPages.allocate(pair.config, 16, PAGE, dtype=torch.bfloat16)
    logits = model.forward(ForwardBatch.build([(tokens, 0, list(range(pages_for(40))))], logits="all"), kv)
    ref = pair.reference_logits(tokens)
    assert logits.dtype == torch.float32
    assert float((logits - ref).abs().max()) < 0.1 * float(ref.abs().max())


def test_missing_and_misshapen_weights_are_named(pair: Pair) -> None:
    name = "model.layers.1.mlp.down_proj.weight"
    missing = {k: v for k, v in pair.weights.items() if k != name}
    with pytest.raises(ValueError, match=f"weight '{name}' is missing"):
        build_model(pair.config, missing)
    misshapen = dict(pair.weights, **{name: pair.weights[name].T.contiguous()})
    with pytest.raises(ValueError, match=f"weight '{name}' has shape"):
        build_model(pair.config, misshapen)


def test_unknown_architecture_and_mismatched_pool_are_refused(pair: Pair) -> None:
    with pytest.raises(UnsupportedModelError, match="architecture 'mamba' has no adapter"):
        build_model(replace(pair.config, architecture="mamba"), pair.weights)
    other = replace(pair.config, num_layers=pair.config.num_layers + 1)
    with pytest.raises(ValueError, match="KV pool shaped for"):
        pair.ours.forward(ForwardBatch.build([([5], 0, [0])]), KVPages.allocate(other, 4, PAGE))
