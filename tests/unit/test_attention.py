"""Paged attention equals dense causal (and sliding-window) attention over the same keys.

Random queries, keys and values; a resident prefix written straight into
shuffled pages (or consecutive ones, which one sequence reads in place); new
tokens written by ``write_kv`` at the plan's slots. The reference is the
textbook formula on dense per-sequence tensors.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from kvrelay.models.batch import ForwardBatch
from kvrelay.models.config import ModelConfig
from kvrelay.models.kernels import attention
from kvrelay.models.kernels.attention import GatherBuffers, paged_attention
from kvrelay.models.kernels.attention_plan import GROUP_COST_TOKENS, AttentionPlan, plan_attention, split_by_length
from kvrelay.models.kernels.kv_pages import KVPages, write_kv
from tests.support.torch_threads import one_thread  # noqa: F401  (autouse: torch on one thread)

PAGE = 4
HEADS, KV_HEADS, DIM = 4, 2, 8
SCALE = 0.3


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, window: int | None):
    """``q`` [Q, H, D] at ``q_pos`` over keys/values [S, KVH, D] at positions 0..S-1."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,shd->hqs", q, k) * SCALE
    kv_pos = torch.arange(k.shape[0])
    visible = kv_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= kv_pos[None, :] > q_pos[:, None] - window
    scores = scores.masked_fill(~visible, -math.inf)
    return torch.einsum("hqs,shd->qhd", scores.softmax(-1), v)


def run_case(
    starts: list[int], new: list[int], window: int | None, seed: int, consecutive: bool = False
) -> AttentionPlan:
    """Check paged attention against dense attention; pages shuffled, or handed out in order (``consecutive``)."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = sum((s + n + PAGE - 1) // PAGE for s, n in zip(starts, new, strict=True)) + 3
    pool_k = torch.zeros(num_pages, PAGE, KV_HEADS, DIM)
    pool_v = torch.zeros(num_pages, PAGE, KV_HEADS, DIM)
    free = list(range(num_pages))[::-1] if consecutive else torch.randperm(num_pages, generator=gen).tolist()
    seqs, histories = [], []
    for start, n in zip(starts, new, strict=True):
        total = start + n
        table = [free.pop() for _ in range((total + PAGE - 1) // PAGE)]
        k_hist = torch.randn(total, KV_HEADS, DIM, generator=gen)
        v_hist = torch.randn(total, KV_HEADS, DIM, generator=gen)
        for p in range(start):
            pool_k[table[p // PAGE], p % PAGE] = k_hist[p]
            pool_v[table[p // PAGE], p % PAGE] = v_hist[p]
        seqs.append(([7] * n, start, table))
        histories.append((k_hist, v_hist))
    batch = ForwardBatch.build(seqs, logits="all")
    plan = plan_attention(batch, PAGE, window, torch.device("cpu"), torch.float32)
    new_k = torch.cat([k[s:] for (k, _), s in zip(histories, starts, strict=True)])
    new_v = torch.cat([v[s:] for (_, v), s in zip(histories, starts, strict=True)])
    write_kv(pool_k, pool_v, plan.slots, new_k, new_v, plan.slot_run)
    q = torch.randn(batch.num_tokens, HEADS, DIM, generator=gen)
    groups = plan.sliding if window else plan.full
    out = paged_attention(q, pool_k, pool_v, groups, SCALE, GatherBuffers())
    row = 0
    for (k_hist, v_hist), start, n in zip(histories, starts, new, strict=True):
        q_pos = torch.arange(start, start + n)
        want = dense_attention(q[row : row + n], k_hist, v_hist, q_pos, window)
        torch.testing.assert_close(out[row : row + n], want, rtol=1e-5, atol=1e-5)
        row += n
    gathered = tuple(replace(group, page_run=None) for group in groups)
    assert torch.equal(paged_attention(q, pool_k, pool_v, gathered, SCALE, GatherBuffers()), out)
    return plan


@pytest.mark.parametrize("window", [None, 5, 9])
def test_decode_batch_of_different_lengths(window: int | None) -> None:
    run_case(starts=[0, 3, 11, 30, 17], new=[1, 1, 1, 1, 1], window=window, seed=1)


@pytest.mark.parametrize("window", [None, 6])
def test_prefill_with_and_without_resident_prefix(window: int | None) -> None:
    run_case(starts=[0, 13], new=[19, 10], window=window, seed=2)


@pytest.mark.parametrize("window", [None, 7])
def test_mixed_prefill_and_decode_in_one_step(window: int | None) -> None:
    run_case(starts=[22, 0, 9, 5, 40], new=[1, 14, 6, 1, 1], window=window, seed=3)


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize(("start", "new"), [(0, 19), (13, 10), (30, 1)])
def test_one_sequence_on_consecutive_pages_is_read_in_place(window: int | None, start: int, new: int) -> None:
    plan = run_case(starts=[start], new=[new], window=window, seed=4, consecutive=True)
    groups = plan.sliding if window else plan.full
    assert groups and all(group.page_run is not None for group in groups)


def test_shuffled_or_shared_pages_are_gathered() -> None:
    plan = run_case(starts=[13], new=[10], window=None, seed=5)
    assert all(group.page_run is None for group in plan.full)
    plan = run_case(starts=[3, 11], new=[1, 1], window=None, seed=5, consecutive=True)
    shared = [group for group in plan.full if group.pages.shape[0] > 1]
    assert shared and all(group.page_run is None for group in shared)


@pytest.mark.parametrize("window", [None, 1200])
def test_decodes_of_very_different_lengths_split_into_groups(window: int | None) -> None:
    starts = [0, 2, 1500, 7, 1490, 600]
    batch = ForwardBatch.build([([7], s, list(range((s + PAGE) // PAGE))) for s in starts])
    plan = plan_attention(batch, PAGE, window, torch.device("cpu"), torch.float32)
    assert len(plan.sliding if window else plan.full) > 1
    run_case(starts=starts, new=[1] * len(starts), window=window, seed=6)


def test_split_by_length_trades_padding_against_groups() -> None:
    lengths = [64, 4096, 80, 4000, 2048, 96]
    groups = split_by_length(lengths, GROUP_COST_TOKENS)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert groups == [[0, 2, 5], [4], [1, 3]]
    assert split_by_length([512] * 7 + [480], GROUP_COST_TOKENS) == [list(range(8))]
    assert split_by_length([], GROUP_COST_TOKENS) == []


def test_single_sequence_decode_and_prefill() -> None:
    run_case(starts=[26], new=[1], window=None, seed=4)
    run_case(starts=[0], new=[23], window=3, seed=5)
    run_case(starts=[0], new=[23], window=23, seed=5)


MASKED = torch.device("meta")
"""A device other than the CPU, for the plans of devices that attend a prefill through its mask (no tensor data
is needed to check which groups carry one)."""


def test_fresh_prefill_uses_the_plain_causal_path_only_where_the_window_does_not_bind() -> None:
    batch = ForwardBatch.build([([7] * 12, 0, [0, 1, 2]), ([7] * 5, 3, [3, 4])])
    plan = plan_attention(batch, PAGE, 12, MASKED, torch.float32)
    assert plan.full[0].mask is None and plan.sliding[0].mask is None
    assert plan.full[1].mask is not None
    narrow = plan_attention(batch, PAGE, 11, MASKED, torch.float32)
    assert narrow.full[0].mask is None
    assert narrow.sliding[0].mask is None and narrow.sliding[0].queries_per_seq == 11
    assert narrow.sliding[1].mask is not None and narrow.sliding[1].queries_per_seq == 1


def test_a_cpu_attends_every_prefill_by_its_span_without_a_mask() -> None:
    batch = ForwardBatch.build([([7] * 12, 0, [0, 1, 2]), ([7] * 5, 3, [3, 4])])
    plan = plan_attention(batch, PAGE, 11, torch.device("cpu"), torch.float32)
    for group in (*plan.full, *plan.sliding):
        assert group.mask is None and group.span is not None
    assert [g.queries_per_seq for g in plan.sliding] == [12, 5]


def test_long_prefill_attends_window_by_window_in_sliding_layers() -> None:
    run_case(starts=[0, 5], new=[37, 29], window=8, seed=9)
    batch = ForwardBatch.build([([7] * 37, 0, list(range(10)))])
    plan = plan_attention(batch, PAGE, 8, MASKED, torch.float32)
    assert [g.queries_per_seq for g in plan.sliding] == [8, 8, 8, 8, 5]
    assert max(g.pages.shape[1] * PAGE for g in plan.sliding) <= 2 * 8 + PAGE
    on_cpu = plan_attention(batch, PAGE, 8, torch.device("cpu"), torch.float32)
    assert [g.queries_per_seq for g in on_cpu.sliding] == [37]


def test_plan_names_a_short_page_table() -> None:
    batch = ForwardBatch.build([([1, 2, 3], 0, [0]), ([1] * 9, 0, [1, 2])])
    with pytest.raises(ValueError, match="sequence 1: 9 tokens need 3 pages of 4 tokens; its page table has 2"):
        plan_attention(batch, PAGE, None, torch.device("cpu"), torch.float32)


def test_plan_names_positions_that_disagree_with_seq_lens() -> None:
    good = ForwardBatch.build([([1, 2], 3, [0, 1])])
    bad = ForwardBatch(
        input_ids=good.input_ids,
        positions=torch.tensor([0, 1]),
        query_lens=good.query_lens,
        seq_lens=good.seq_lens,
        page_tables=good.page_tables,
        logits_indices=good.logits_indices,
    )
    with pytest.raises(ValueError, match="sequence 0: its last new token is at position 1, but seq_len 5"):
        plan_attention(bad, PAGE, None, torch.device("cpu"), torch.float32)


def test_build_lays_out_tokens_positions_and_logit_rows() -> None:
    batch = ForwardBatch.build([([5, 6, 7], 2, [4, 9]), ([8], 10, [1, 2, 3])])
    assert batch.input_ids.tolist() == [5, 6, 7, 8]
    assert batch.positions.tolist() == [2, 3, 4, 10]
    assert batch.query_lens == [3, 1] and batch.seq_lens == [5, 11]
    assert batch.page_tables.tolist() == [[4, 9, 0], [1, 2, 3]]
    assert batch.logits_indices.tolist() == [2, 3]
    assert ForwardBatch.build([([5, 6], 0, [0])], logits="all").logits_indices.tolist() == [0, 1]


def test_build_refuses_empty_input() -> None:
    with pytest.raises(ValueError, match="at least one sequence"):
        ForwardBatch.build([])
    with pytest.raises(ValueError, match="sequence 0: needs at least one new token"):
        ForwardBatch.build([([], 0, [0])])


def test_allocate_shapes_the_pool_from_the_config() -> None:
    config = ModelConfig(
        architecture="llama",
        vocab_size=10,
        hidden_size=16,
        intermediate_size=32,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=4,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        layer_types=("full_attention",) * 3,
    )
    kv = KVPages.allocate(config, num_pages=5, page_tokens=8, dtype=torch.bfloat16)
    assert kv.k.shape == kv.v.shape == (3, 5, 8, 2, 4)
    assert (kv.num_pages, kv.page_tokens, kv.dtype) == (5, 8, torch.bfloat16)
    assert kv.page_bytes() == 2 * 3 * 8 * 2 * 4 * 2
    assert not kv.k.any() and not kv.v.any()


def test_decode_attention_equals_dense_attention_under_a_mask() -> None:
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(5, KV_HEADS, HEADS // KV_HEADS, DIM, generator=gen)
    k = torch.randn(5, KV_HEADS, 12, DIM, generator=gen)
    v = torch.randn(5, KV_HEADS, 12, DIM, generator=gen)
    visible = torch.arange(12) < torch.tensor([12, 1, 7, 3, 9]).view(5, 1, 1, 1)
    mask = torch.zeros(5, 1, 1, 12).masked_fill_(~visible, float("-inf"))
    scores = torch.einsum("bhgd,bhsd->bhgs", q, k) * SCALE + mask
    want = torch.einsum("bhgs,bhsd->bhgd", scores.softmax(-1), v)
    torch.testing.assert_close(attention.decode_attention(q, k, v, mask, SCALE), want, rtol=1e-5, atol=1e-5)


def test_a_prefill_in_consecutive_pages_is_written_as_one_slice() -> None:
    """``slot_run`` names the first slot where a step's slots are consecutive; written there as a slice, the
    pool holds what the indexed write gives."""
    plan = run_case(starts=[5], new=[11], window=None, seed=12, consecutive=True)
    assert plan.slot_run is not None and torch.equal(
        plan.slots, torch.arange(plan.slot_run, plan.slot_run + plan.num_tokens)
    )
    assert run_case(starts=[0, 3], new=[6, 1], window=None, seed=12).slot_run is None
    gen = torch.Generator().manual_seed(13)
    k, v = torch.randn(2, 11, KV_HEADS, DIM, generator=gen)
    sliced, indexed = torch.zeros(2, 6, PAGE, KV_HEADS, DIM), torch.zeros(2, 6, PAGE, KV_HEADS, DIM)
    slots = torch.arange(9, 20)
    write_kv(sliced[0], sliced[1], slots, k, v, slot_run=9)
    write_kv(indexed[0], indexed[1], slots, k, v)
    assert torch.equal(sliced, indexed) and sliced.count_nonzero() > 0
