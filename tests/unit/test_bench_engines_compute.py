"""The engines bench's machine limits: FLOPs and bytes of one decoded token, counted by hand for a small config."""

from __future__ import annotations

import pytest

from kvrelay.bench.engines.compute import bytes_per_token, flops_per_token, prefill_flops, read_rate
from kvrelay.models.config import ModelConfig

HF = {
    "model_type": "gemma3_text",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "vocab_size": 1000,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention"],
    "max_position_embeddings": 512,
}


def test_bytes_per_token_counts_weights_head_and_the_keys_each_layer_sees() -> None:
    config = ModelConfig.from_hf(HF)
    projections = 2 * (64 * (4 + 2) * 16 + 4 * 16 * 64 + 3 * 64 * 128) * 2  # two layers, bfloat16
    kv = (8 + 20) * 2 * 1 * 16 * 2  # the sliding layer sees its window of 8, the full one all 20 positions
    assert bytes_per_token(config, 20, 2 * 64) == projections + 1000 * 128 + kv
    assert bytes_per_token(config, 20, 64 + 36) == projections + 1000 * 100 + kv


def test_flops_per_token_counts_projections_head_and_attention() -> None:
    config = ModelConfig.from_hf(HF)
    macs = 2 * (64 * 6 * 16 + 64 * 64 + 3 * 64 * 128) + 1000 * 64 + 2 * 4 * 16 * (8 + 20)
    assert flops_per_token(config, 20) == pytest.approx(2 * macs)


@pytest.mark.parametrize("tokens", [1, 5, 8, 9, 37])
def test_prefill_flops_are_each_positions_token_without_the_head_but_the_last(tokens: int) -> None:
    config = ModelConfig.from_hf(HF)
    head = 2 * 1000 * 64
    by_token = sum(flops_per_token(config, position) - head for position in range(1, tokens + 1)) + head
    assert prefill_flops(config, tokens) == pytest.approx(by_token)


def test_read_rate_is_a_positive_rate_and_restores_the_thread_count() -> None:
    import torch

    before = torch.get_num_threads()
    assert read_rate(1, mib=16, repeats=2) > 0
    assert torch.get_num_threads() == before
