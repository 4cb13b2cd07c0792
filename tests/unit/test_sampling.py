"""Sampling: greedy, filters that agree with transformers' warpers, and draws fixed by (seed, position)."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from kvrelay.models import sampling
from kvrelay.models.sampling import (
    finish_reason,
    greedy_tokens,
    sample_next,
    sample_row,
    uniform_draw,
)
from kvrelay.protocol.messages import Sampling
from tests.support.torch_threads import one_thread  # noqa: F401  (autouse: torch on one thread)


def random_logits(rows: int, vocab: int, seed: int, spread: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * spread


def reference_pick(row: torch.Tensor, params: Sampling, u: float) -> int:
    """transformers' warpers, then the inverse CDF: over the surviving tokens sorted by probability when a
    filter is on, over the whole vocabulary in id order when none is."""
    scores = row.float().unsqueeze(0)
    scores = TemperatureLogitsWarper(params.temperature)(None, scores)
    if params.top_k:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1.0:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    probs = scores.softmax(-1)[0]
    filtered = params.top_k > 0 or params.top_p < 1.0
    order = probs.argsort(descending=True) if filtered else torch.arange(probs.shape[0])
    kept = order[probs[order] > 0]
    cdf = probs[kept].cumsum(0)
    return int(kept[min(int((cdf <= u * cdf[-1]).sum()), len(kept) - 1)])


def test_temperature_zero_is_argmax_with_lowest_id_on_ties() -> None:
    logits = random_logits(3, 50, seed=1)
    logits[2, 7] = logits[2, 30] = logits[2].max() + 1.0
    tokens = sample_next(logits, [Sampling()] * 3, [5, 6, 7])
    assert tokens[:2] == logits[:2].argmax(-1).tolist()
    assert tokens[2] == 7


@pytest.mark.parametrize("vocab", [5000, 4096 * 2, 4096 * 2 + 1000])
def test_blockwise_greedy_equals_argmax_including_ties_and_a_partial_last_block(vocab: int) -> None:
    logits = random_logits(6, vocab, seed=vocab)
    top = float(logits.max()) + 1.0
    logits[1, [vocab - 1]] = top
    logits[2, [5, 4000]] = top
    logits[3, [1500, 1023]] = top
    logits[4, [vocab - 2, vocab - 1]] = top
    assert greedy_tokens(logits).tolist() == logits.argmax(-1).tolist()
    assert greedy_tokens(logits)[[2, 3, 4]].tolist() == [5, 1023, vocab - 2]


@pytest.mark.parametrize(
    "params",
    [
        Sampling(temperature=0.7, seed=1),
        Sampling(temperature=1.3, top_k=5, seed=2),
        Sampling(temperature=1.0, top_p=0.6, seed=3),
        Sampling(temperature=0.9, top_k=40, top_p=0.8, seed=4),
    ],
    ids=["temperature", "top_k", "top_p", "top_k+top_p"],
)
def test_filters_agree_with_transformers_warpers(params: Sampling) -> None:
    logits = random_logits(1, 300, seed=params.seed)[0]
    draws = [uniform_draw(params.seed, p) for p in range(150)]
    assert [sample_row(logits, params, u) for u in draws] == [reference_pick(logits, params, u) for u in draws]


def test_top_k_draws_only_the_k_most_likely_with_their_renormalized_odds() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 3.0, -1.0, 2.5])
    params = Sampling(temperature=1.0, top_k=3, seed=11)
    tokens = [sample_next(logits.unsqueeze(0), [params], [p])[0] for p in range(3000)]
    assert set(tokens) == {0, 3, 5}
    odds = torch.softmax(logits[[0, 3, 5]], 0)
    for token, p in zip([0, 3, 5], odds.tolist(), strict=True):
        assert abs(tokens.count(token) / len(tokens) - p) < 0.03


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass() -> None:
    logits = torch.log(torch.tensor([0.05, 0.5, 0.15, 0.3]))
    for top_p, nucleus in [(0.4, {1}), (0.75, {1, 3}), (0.9, {1, 3, 2}), (0.99, {0, 1, 2, 3})]:
        params = Sampling(temperature=1.0, top_p=top_p, seed=5)
        assert {sample_next(logits.unsqueeze(0), [params], [p])[0] for p in range(400)} == nucleus


def test_top_p_beyond_the_probe_sorts_the_whole_vocabulary() -> None:
    vocab = sampling.NUCLEUS_PROBES[-1] * 4
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(0)) * 0.01
    params = Sampling(temperature=1.0, top_p=0.9, seed=8)
    draws = [uniform_draw(8, p) for p in range(300)]
    tokens = [sample_row(logits, params, u) for u in draws]
    expected = [reference_pick(logits, params, u) for u in draws]
    rank = torch.empty(vocab, dtype=torch.long)
    rank[logits.argsort(descending=True)] = torch.arange(vocab)
    # ~3,700 near-equal probabilities: float32 cumsums may split a CDF boundary differently, by one rank.
    assert all(abs(int(rank[a]) - int(rank[b])) <= 1 for a, b in zip(tokens, expected, strict=True))
    assert sum(a != b for a, b in zip(tokens, expected, strict=True)) <= 3
    assert max(int(rank[t]) for t in tokens) > sampling.NUCLEUS_PROBES[-1]


def test_draws_depend_only_on_seed_and_position_not_on_the_batch() -> None:
    vocab = 500
    logits = random_logits(6, vocab, seed=2)
    mine = Sampling(temperature=1.0, top_p=0.95, seed=42)
    alone = [sample_next(logits[3:4], [mine], [p])[0] for p in range(20, 40)]
    others = [Sampling(), Sampling(temperature=0.5, top_k=3, seed=1), Sampling(temperature=2.0, seed=42)]
    in_batch = []
    for p in range(20, 40):
        rows = torch.cat([logits[0:2], logits[3:4], logits[5:6]])
        params = [others[p % 3], others[(p + 1) % 3], mine, others[(p + 2) % 3]]
        in_batch.append(sample_next(rows, params, [p + 7, 3, p, p])[2])
    assert alone == in_batch
    assert len(set(alone)) > 5, "the draws should vary with the position"
    resumed = [sample_next(logits[3:4], [mine], [p])[0] for p in range(30, 40)]
    assert resumed == alone[10:]


def test_uniform_draw_is_fixed_in_range_and_seed_sensitive() -> None:
    values = [uniform_draw(s, p) for s in (0, 1, -5) for p in range(200)]
    assert all(0.0 <= v < 1.0 for v in values)
    assert len(set(values)) == len(values)
    assert uniform_draw(7, 123) == uniform_draw(7, 123)
    assert abs(sum(values) / len(values) - 0.5) < 0.05


def test_finish_reason_prefers_stop_tokens_to_the_length_limit() -> None:
    params = Sampling(stop_token_ids=(1, 9))
    assert finish_reason(9, 3, params, max_new_tokens=3) == "stop"
    assert finish_reason(4, 3, params, max_new_tokens=3) == "length"
    assert finish_reason(4, 2, params, max_new_tokens=3) is None


def test_mismatched_rows_are_refused() -> None:
    with pytest.raises(ValueError, match="B == len\\(params\\) == len\\(positions\\)"):
        sample_next(torch.zeros(2, 5), [Sampling()], [0, 1])


def test_greedy_on_bfloat16_logits_picks_what_float32_picks() -> None:
    logits = random_logits(6, 5000, seed=9).bfloat16()
    logits[2, 17] = logits[2, 4000] = logits[2].max() + 1  # a tie: the lowest id wins in both dtypes
    chosen = sample_next(logits, [Sampling()] * 6, list(range(6)))
    assert chosen == sample_next(logits.float(), [Sampling()] * 6, list(range(6)))
    assert chosen == logits.float().argmax(-1).tolist() and chosen[2] == 17
