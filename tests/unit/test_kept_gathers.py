"""Kept full-attention decode windows give what a fresh gather gives, step after step.

Several laned sequences decode together over shuffled pages; each step the full-layer
attention through one ``GatherBuffers`` (which keeps windows between steps) must equal
the attention through a fresh ``GatherBuffers`` and the dense reference. The cases change
what identifies a group (a lane's owner, a page id, a skipped step) and check that the
kept window is gathered afresh, not reused.
"""

from __future__ import annotations

import torch

from kvrelay.models.batch import ForwardBatch, LaneRef
from kvrelay.models.kernels.attention import GatherBuffers, paged_attention
from kvrelay.models.kernels.attention_plan import KEPT_PAGE_QUANTUM, plan_attention
from kvrelay.models.kernels.kv_pages import write_kv
from tests.support.torch_threads import one_thread  # noqa: F401  (autouse: torch on one thread)
from tests.unit.test_attention import DIM, HEADS, KV_HEADS, PAGE, SCALE, dense_attention


class Decoding:
    """Sequences with random key/value histories in shuffled pages of one pool."""

    def __init__(self, starts: list[int], steps: int, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        pages = [(s + steps + PAGE - 1) // PAGE for s in starts]
        self.pool_k = torch.zeros(sum(pages) + 4, PAGE, KV_HEADS, DIM)
        self.pool_v = torch.zeros_like(self.pool_k)
        free = torch.randperm(self.pool_k.shape[0], generator=self.gen).tolist()
        self.tables = [[free.pop() for _ in range(n)] for n in pages]
        self.spare = free
        self.lengths = list(starts)
        self.k = [torch.randn(s + steps, KV_HEADS, DIM, generator=self.gen) for s in starts]
        self.v = [torch.randn(s + steps, KV_HEADS, DIM, generator=self.gen) for s in starts]
        for i, start in enumerate(starts):
            for p in range(start - 1):
                self.write_history(i, p)
        self.lengths = [s - 1 for s in starts]

    def rewrite(self, i: int, positions: range) -> None:
        """Give sequence ``i`` new keys and values at ``positions`` and write them to its pages."""
        for p in positions:
            self.k[i][p] = torch.randn(KV_HEADS, DIM, generator=self.gen)
            self.v[i][p] = torch.randn(KV_HEADS, DIM, generator=self.gen)
            self.write_history(i, p)

    def write_history(self, i: int, p: int) -> None:
        page, offset = self.tables[i][p // PAGE], p % PAGE
        self.pool_k[page, offset] = self.k[i][p]
        self.pool_v[page, offset] = self.v[i][p]

    def step(self, buffers: GatherBuffers, lanes: list[LaneRef]) -> None:
        """Decode one token of every sequence; assert kept, fresh and dense attention agree."""
        batch = ForwardBatch.build(
            [([7], n, table) for n, table in zip(self.lengths, self.tables, strict=True)], lanes=lanes
        )
        plan = plan_attention(batch, PAGE, None, torch.device("cpu"), torch.float32)
        assert all(group.kept is not None for group in plan.full)
        new_k = torch.stack([k[n] for k, n in zip(self.k, self.lengths, strict=True)])
        new_v = torch.stack([v[n] for v, n in zip(self.v, self.lengths, strict=True)])
        write_kv(self.pool_k, self.pool_v, plan.slots, new_k, new_v)
        q = torch.randn(len(self.lengths), HEADS, DIM, generator=self.gen)
        kept = paged_attention(q, self.pool_k, self.pool_v, plan.full, SCALE, buffers)
        buffers.kept.end_step()
        fresh = paged_attention(q, self.pool_k, self.pool_v, plan.full, SCALE, GatherBuffers())
        assert torch.equal(kept, fresh)
        for i, n in enumerate(self.lengths):
            want = dense_attention(q[i : i + 1], self.k[i][: n + 1], self.v[i][: n + 1], torch.tensor([n]), None)
            torch.testing.assert_close(kept[i : i + 1], want, rtol=1e-5, atol=1e-5)
        self.lengths = [n + 1 for n in self.lengths]


def lanes_of(owners: list[int]) -> list[LaneRef]:
    return [LaneRef(slot, owner) for slot, owner in enumerate(owners)]


def test_kept_windows_match_fresh_gathers_across_many_steps() -> None:
    run = Decoding([3, 9, 17, 30], steps=3 * PAGE * KEPT_PAGE_QUANTUM, seed=1)
    buffers = GatherBuffers()
    for _ in range(3 * PAGE * KEPT_PAGE_QUANTUM):
        run.step(buffers, lanes_of([10, 11, 12, 13]))
    assert 0 < len(buffers.kept) <= 4


def test_a_new_owner_in_a_lane_is_gathered_afresh() -> None:
    run = Decoding([5, 6], steps=4, seed=2)
    buffers = GatherBuffers()
    run.step(buffers, lanes_of([1, 2]))
    run.step(buffers, lanes_of([1, 2]))
    run.rewrite(1, range(run.lengths[1]))  # another sequence, as long, on the same pages
    run.step(buffers, lanes_of([1, 3]))
    run.step(buffers, lanes_of([1, 3]))


def test_changed_pages_and_skipped_steps_are_gathered_afresh() -> None:
    run = Decoding([6, 7], steps=6, seed=3)
    buffers = GatherBuffers()
    lanes = lanes_of([1, 2])
    run.step(buffers, lanes)
    run.step(buffers, lanes)
    # Sequence 0's first page becomes a spare page holding other keys: same owners and lengths.
    run.tables[0][0] = run.spare.pop()
    run.rewrite(0, range(PAGE))
    run.step(buffers, lanes)
    # Skip a step for sequence 1 (its token written elsewhere): lengths jump by two.
    run.write_history(1, run.lengths[1])
    run.lengths[1] += 1
    run.step(buffers, lanes)


def test_unused_windows_are_dropped_at_the_end_of_a_step_and_all_on_clear() -> None:
    run = Decoding([4, 12], steps=3, seed=4)
    buffers = GatherBuffers()
    run.step(buffers, lanes_of([1, 2]))
    kept_before = len(buffers.kept)
    assert kept_before >= 1
    buffers.kept.end_step()  # a step that used none of them
    assert len(buffers.kept) == 0
    run.step(buffers, lanes_of([1, 2]))
    buffers.kept.clear()
    assert len(buffers.kept) == 0
    run.step(buffers, lanes_of([1, 2]))


def test_batches_without_lanes_keep_nothing() -> None:
    batch = ForwardBatch.build([([7], 5, [0, 1]), ([7], 9, [2, 3, 4])])
    plan = plan_attention(batch, PAGE, None, torch.device("cpu"), torch.float32)
    assert all(group.kept is None for group in plan.full)


def test_a_decode_row_without_a_lane_turns_keeping_and_its_padding_off() -> None:
    tables = [([7], 5, [0, 1]), ([7], 9, [2, 3, 4])]
    laned = plan_attention(
        ForwardBatch.build(tables, lanes=lanes_of([1, 2])), PAGE, None, torch.device("cpu"), torch.float32
    )
    assert all(group.kept is not None and group.pages.shape[1] % KEPT_PAGE_QUANTUM == 0 for group in laned.full)
    mixed = plan_attention(
        ForwardBatch.build(tables, lanes=[LaneRef(0, 1), None]), PAGE, None, torch.device("cpu"), torch.float32
    )
    assert all(group.kept is None for group in mixed.full)
    assert max(group.pages.shape[1] for group in mixed.full) == -(-9 // PAGE)
