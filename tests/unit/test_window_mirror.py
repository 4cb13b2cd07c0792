"""Decode rows with lanes (sliding layers read per-lane rings) give the logits of plain paged decode.

Two copies of one tiny Gemma 3 (sliding window 16) run the same steps on two
pools: one names lanes (so its sliding layers use ``WindowMirror``), one does not.
The steps cover rings that wrap past the window, lanes out of order with gaps,
mixed prefill and decode rows, a lane handed to another owner, and a sequence
that takes a multi-token row between decodes (a stale ring, rebuilt from pages).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvrelay.models.batch import ForwardBatch, LaneRef
from kvrelay.models.config import ModelConfig
from kvrelay.models.kernels.kv_pages import KVPages
from kvrelay.models.layers import PagedModel
from kvrelay.models.registry import build_model
from kvrelay.testing.tiny_models import make_tiny_model
from tests.support.torch_threads import one_thread  # noqa: F401  (autouse: torch on one thread)

PAGE = 4
PAGES_EACH = 20


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[PagedModel, PagedModel]:
    directory: Path = make_tiny_model("gemma3", tmp_path_factory.mktemp("gemma3"), seed=7)
    config = ModelConfig.from_hf(json.loads((directory / "config.json").read_text()))
    weights = load_file(directory / "model.safetensors")
    return build_model(config, weights), build_model(config, weights)


class Seq:
    def __init__(self, prompt: list[int], table: list[int], lane: int, owner: int) -> None:
        self.tokens, self.table, self.lane, self.owner, self.written = prompt, table, lane, owner, 0


def step(models: tuple[PagedModel, PagedModel], pools: tuple[KVPages, KVPages], rows: list[tuple[Seq, int]]) -> None:
    """Feed ``n`` next tokens of each ``(seq, n)`` through both models; their logits must agree."""
    seqs = [(s.tokens[s.written : s.written + n], s.written, s.table) for s, n in rows]
    lanes = [LaneRef(s.lane, s.owner) for s, _ in rows]
    mirrored = models[0].forward(ForwardBatch.build(seqs, lanes=lanes), pools[0])
    paged = models[1].forward(ForwardBatch.build(seqs), pools[1])
    scale = paged.abs().max().item()
    torch.testing.assert_close(mirrored, paged, rtol=0, atol=1e-5 * scale)
    for s, n in rows:
        s.written += n


def test_mirrored_decode_matches_paged_decode(pair: tuple[PagedModel, PagedModel]) -> None:
    config = pair[0].config
    assert config.sliding_window == 16
    gen = torch.Generator().manual_seed(5)
    pools = tuple(KVPages.allocate(config, 6 * PAGES_EACH, PAGE) for _ in range(2))
    order = torch.randperm(6 * PAGES_EACH, generator=gen).tolist()

    def new_seq(i: int, lane: int, owner: int) -> Seq:
        prompt = torch.randint(4, config.vocab_size, (60,), generator=gen).tolist()
        return Seq(prompt, order[i * PAGES_EACH : (i + 1) * PAGES_EACH], lane, owner)

    a, b, c, d = new_seq(0, 5, 1), new_seq(1, 0, 2), new_seq(2, 2, 3), new_seq(3, 3, 4)
    step(pair, pools, [(a, 3), (b, 14), (c, 20)])
    for _ in range(8):  # a's ring fills from empty; b and c wrap past the window
        step(pair, pools, [(a, 1), (b, 1), (c, 1)])
    step(pair, pools, [(a, 1), (d, 9), (c, 1)])  # mixed: a prefill row between decode rows
    step(pair, pools, [(d, 1), (c, 1), (a, 1)])  # lanes 3, 2, 5: out of order, lane 4 idle
    step(pair, pools, [(c, 3), (a, 1), (d, 1)])  # c takes three tokens: its ring goes stale
    for _ in range(3):
        step(pair, pools, [(a, 1), (c, 1), (d, 1)])
    e = new_seq(4, 2, 5)  # lane 2 changes owner: its ring must not leak c's keys
    step(pair, pools, [(e, 30), (a, 1)])
    for _ in range(4):
        step(pair, pools, [(a, 1), (e, 1), (d, 1)])
    assert pair[0].mirror is not None and pair[0].mirror.k.shape[1] >= 6


def test_decode_rows_sharing_a_lane_are_refused(pair: tuple[PagedModel, PagedModel]) -> None:
    kv = KVPages.allocate(pair[0].config, 8, PAGE)
    batch = ForwardBatch.build([([5], 3, [0]), ([6], 3, [1])], lanes=[LaneRef(1, 1), LaneRef(1, 2)])
    with pytest.raises(ValueError, match="distinct lane slots"):
        pair[0].forward(batch, kv)
