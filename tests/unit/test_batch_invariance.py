"""A sequence decodes to the same tokens alone and inside a busy mixed batch.

Sixteen sequences of mixed prompt lengths (some past the tiny Gemma 3 sliding
window) start at staggered steps, prefill in chunks while others decode, and
share one page pool. Each must produce exactly the tokens it produces when run
alone, greedily and under seeded sampling.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvrelay.models.batch import ForwardBatch
from kvrelay.models.config import ModelConfig
from kvrelay.models.kernels.kv_pages import KVPages
from kvrelay.models.layers import PagedModel
from kvrelay.models.registry import build_model
from kvrelay.models.sampling import sample_next
from kvrelay.protocol.messages import Sampling
from kvrelay.testing.tiny_models import make_tiny_model
from tests.support.torch_threads import one_thread  # noqa: F401  (autouse: torch on one thread)

PAGE = 8
NEW_TOKENS = 10
CHUNK = 16
PROMPT_LENS = [3, 41, 17, 60, 9, 33, 25, 52, 1, 47, 12, 38, 29, 56, 6, 20]


@dataclass
class Seq:
    prompt: list[int]
    params: Sampling
    table: list[int]
    start_step: int = 0
    written: int = 0
    out: list[int] = field(default_factory=list)

    def done(self) -> bool:
        return len(self.out) >= NEW_TOKENS

    def next_piece(self) -> tuple[list[int], int]:
        """The tokens this sequence feeds at its next step, and their start position."""
        if self.written < len(self.prompt):
            return self.prompt[self.written : self.written + CHUNK], self.written
        return [self.out[-1]], self.written


def run(model: PagedModel, kv: KVPages, seqs: list[Seq]) -> None:
    """Step every started, unfinished sequence together until all have NEW_TOKENS tokens."""
    step = 0
    while not all(s.done() for s in seqs):
        active = [s for s in seqs if s.start_step <= step and not s.done()]
        step += 1
        if not active:
            continue
        pieces = [s.next_piece() for s in active]
        batch = ForwardBatch.build(
            [(tokens, start, s.table) for s, (tokens, start) in zip(active, pieces, strict=True)]
        )
        logits = model.forward(batch, kv)
        for s, (tokens, _) in zip(active, pieces, strict=True):
            s.written += len(tokens)
        wanting = [i for i, s in enumerate(active) if s.written >= len(s.prompt)]
        chosen = sample_next(logits[wanting], [active[i].params for i in wanting], [active[i].written for i in wanting])
        for i, token in zip(wanting, chosen, strict=True):
            active[i].out.append(token)


@pytest.fixture(scope="module", params=["gemma3", "llama"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> PagedModel:
    directory: Path = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param), seed=7)
    config = ModelConfig.from_hf(json.loads((directory / "config.json").read_text()))
    return build_model(config, load_file(directory / "model.safetensors"))


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_batched_decode_equals_decode_alone(model: PagedModel, sampled: bool) -> None:
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(4, model.config.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]

    def params(i: int) -> Sampling:
        return Sampling(temperature=0.8, top_p=0.9, seed=100 + i) if sampled else Sampling()

    pages_each = (max(PROMPT_LENS) + NEW_TOKENS + PAGE - 1) // PAGE
    alone = []
    for i, prompt in enumerate(prompts):
        seq = Seq(prompt, params(i), list(range(pages_each)))
        run(model, KVPages.allocate(model.config, pages_each, PAGE), [seq])
        alone.append(seq.out)

    num_pages = pages_each * len(prompts)
    order = torch.randperm(num_pages, generator=gen).tolist()
    together = [
        Seq(prompt, params(i), order[i * pages_each : (i + 1) * pages_each], start_step=i % 5)
        for i, prompt in enumerate(prompts)
    ]
    run(model, KVPages.allocate(model.config, num_pages, PAGE), together)
    assert [s.out for s in together] == alone
    assert len({tuple(out) for out in alone}) == len(alone), "distinct prompts should continue differently"
