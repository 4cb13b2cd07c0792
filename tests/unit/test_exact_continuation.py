"""A continuation that replays its delivered tokens as decode rows (``Job.replay``) is bit-exact.

Six bfloat16 sequences of a tiny Gemma 3 (sliding window 16, so decode rows wrap
their window rings) decode together; then each is continued from a different
number of delivered tokens, in another batch (other continuations and unrelated
jobs beside it). With ``replay`` every continued token and the K/V of every
position equal the undisturbed run's bit for bit, greedily and under seeded
sampling. Recomputing the delivered tokens in a prefill (``replay=0``, the path
before) writes different K/V for them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvrelay.models.config import ModelConfig
from kvrelay.models.kernels.kv_pages import KVPages
from kvrelay.models.registry import build_model
from kvrelay.protocol.messages import Sampling
from kvrelay.testing.tiny_models import make_tiny_model
from kvrelay.worker.runtime.iteration import PolicyConfig
from kvrelay.worker.runtime.jobs import Job
from kvrelay.worker.runtime.loop import PagedRuntime

PAGE = 4
NEW = 40
PROMPT_LENS = (5, 9, 14, 22, 31, 40)
DELIVERED = (1, 5, 12, 20, 31, 39)
PAGES_EACH = -(-(max(PROMPT_LENS) + NEW) // PAGE)
WAIT = 60.0


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PagedRuntime]:
    directory = make_tiny_model("gemma3", tmp_path_factory.mktemp("gemma3"), seed=5)
    config = ModelConfig.from_hf(json.loads((Path(directory) / "config.json").read_text()))
    model = build_model(config, load_file(str(Path(directory) / "model.safetensors")), torch.bfloat16, "cpu")
    kv = KVPages.allocate(config, 64 * PAGES_EACH, PAGE, torch.bfloat16, "cpu")
    with PagedRuntime(model, kv, PolicyConfig(num_lanes=8, token_budget=512)) as rt:
        yield rt


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(4, 384, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def table(slot: int) -> tuple[int, ...]:
    return tuple(range(slot * PAGES_EACH, (slot + 1) * PAGES_EACH))


def run_together(rt: PagedRuntime, jobs: list[Job]) -> list[tuple[int, ...]]:
    handles = [rt.submit(job) for job in jobs]
    return [h.result(WAIT).tokens for h in handles]


def kv_of(rt: PagedRuntime, pages: tuple[int, ...], lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of positions ``lo .. hi - 1`` of the sequence on ``pages``: ``[layers, hi - lo, ...]``."""
    index = torch.tensor(pages)
    k = rt.kv.k.index_select(1, index).flatten(1, 2)[:, lo:hi].clone()
    v = rt.kv.v.index_select(1, index).flatten(1, 2)[:, lo:hi].clone()
    return k, v


def continue_all(rt: PagedRuntime, sampling: list[Sampling], replay: bool) -> tuple[list[tuple[int, ...]], list[bool]]:
    """Run the undisturbed sequences, then continue each after ``DELIVERED[i]`` tokens; return the undisturbed
    tokens and, per sequence, whether the continuation agrees (tokens equal, K/V of every written position
    equal)."""
    ps = prompts()
    pairs = list(zip(ps, sampling, strict=True))
    reference = run_together(
        rt, [Job(tuple(p), table(i), max_new_tokens=NEW, sampling=s) for i, (p, s) in enumerate(pairs)]
    )
    before = [kv_of(rt, table(i), 0, len(p) + NEW - 1) for i, p in enumerate(ps)]
    jobs = []
    for i, (p, s, d) in enumerate(zip(ps, sampling, DELIVERED, strict=True)):
        tokens = tuple(p) + reference[i][:d]
        jobs.append(Job(tokens, table(10 + i), max_new_tokens=NEW - d, sampling=s, replay=d if replay else 0))
    others = [Job(tuple(range(7, 7 + n)), table(20 + n), max_new_tokens=NEW, sampling=Sampling()) for n in (3, 11)]
    continued = run_together(rt, jobs[:3] + others + jobs[3:])
    continued = continued[:3] + continued[5:]
    same_tokens = [reference[i][d:] == continued[i] for i, d in enumerate(DELIVERED)]
    same_kv = []
    for i, p in enumerate(ps):
        k, v = kv_of(rt, table(10 + i), 0, len(p) + NEW - 1)
        same_kv.append(torch.equal(k, before[i][0]) and torch.equal(v, before[i][1]))
    return reference, [t and kv for t, kv in zip(same_tokens, same_kv, strict=True)]


GREEDY = [Sampling()] * len(PROMPT_LENS)
SEEDED = [Sampling(temperature=0.9, top_p=0.95, seed=40 + i) for i in range(len(PROMPT_LENS))]


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_replayed_continuations_equal_the_undisturbed_run_bit_for_bit(
    runtime: PagedRuntime, sampling: list[Sampling]
) -> None:
    reference, exact = continue_all(runtime, sampling, replay=True)
    assert exact == [True] * len(PROMPT_LENS)
    assert len({tuple(r) for r in reference}) == len(reference), "distinct prompts should continue differently"


def test_a_prefill_of_the_delivered_tokens_is_not_exact(runtime: PagedRuntime) -> None:
    """The control: the same continuations recomputed in a prefill write other K/V for the delivered tokens."""
    _, exact = continue_all(runtime, GREEDY, replay=False)
    assert not all(exact)


def test_replay_must_leave_a_token_to_prefill(runtime: PagedRuntime) -> None:
    with pytest.raises(ValueError, match="replay must be in 0 .. 2"):
        runtime.submit(Job((5, 6, 7), table(0), max_new_tokens=1, replay=3))
