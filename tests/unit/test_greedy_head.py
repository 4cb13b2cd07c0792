"""The screened greedy head picks exactly the full bfloat16 head's greedy token, or declines.

The reference is ``greedy_tokens`` over the full head's logits as the model computes them
(``PackedLinear``: the C GEMV of ``native.linear_row`` on AVX-512, the panels of
``native.linear_avx2`` on AVX2), which the runtime takes when the screen declines. Each test
that runs the kernels runs once per instruction set the CPU has. Random cases print their seed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvrelay.models.batch import ForwardBatch
from kvrelay.models.config import ModelConfig
from kvrelay.models.kernels import greedy_head
from kvrelay.models.kernels.greedy_head import GreedyHead, exact_rows
from kvrelay.models.kernels.kv_pages import KVPages
from kvrelay.models.kernels.native import build, head_screen
from kvrelay.models.mlp import PackedLinear
from kvrelay.models.registry import build_model
from kvrelay.models.sampling import greedy_tokens
from kvrelay.testing.tiny_models import make_tiny_model
from tests.support.bench_smoke import run_bench

needs_kernel = pytest.mark.skipif(
    not head_screen.built(), reason="the native kernels do not run here (no AVX2 or no C compiler)"
)


def full_logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The logits of the full head as a model computes them for one row."""
    return PackedLinear(weight, max_rows=None)(h)


def full_greedy(h: torch.Tensor, weight: torch.Tensor) -> int:
    return int(greedy_tokens(full_logits(h, weight))[0])


def head(rows: int, width: int, seed: int, spread: float = 0.03) -> torch.Tensor:
    return (torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)) * spread).bfloat16()


def outlier_row(width: int, seed: int) -> torch.Tensor:
    """A hidden row like Gemma 3's final norm output: mostly small, a few dims near 50."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(1, width, generator=gen) * 2
    h[0, torch.randint(0, width, (6,), generator=gen)] = 50 * torch.rand(6, generator=gen)
    return h.bfloat16()


@needs_kernel
@pytest.mark.parametrize("seed", range(12))
def test_the_screened_token_is_the_full_heads_token(seed: int, isa: str) -> None:
    print(f"seed {seed}")
    weight = head(20_000, 640, seed)
    screen = GreedyHead.build(weight)
    assert screen is not None
    for trial in range(4):
        h = outlier_row(640, 100 * seed + trial)
        token = screen.argmax(h)
        assert token is not None, "the screen declined an ordinary row"
        assert token == full_greedy(h, weight)


@needs_kernel
def test_tied_maxima_give_the_lowest_id(isa: str) -> None:
    weight = head(4096, 128, seed=1)
    weight[3001] = weight[17] = weight[2500] * 4  # three equal rows, far above the rest
    screen = GreedyHead.build(weight)
    assert screen is not None
    h = weight[2500:2501].clone()
    assert full_greedy(h, weight) == 17
    assert screen.argmax(h) == 17


@needs_kernel
def test_near_ties_are_told_apart_by_the_exact_logits(isa: str) -> None:
    """Rows that differ below the int8 resolution: only the exact bfloat16 logits can order them."""
    weight = head(4096, 256, seed=2)
    base = weight[100].float()
    for i, row in enumerate((400, 800, 1200)):
        nudged = base.clone()
        nudged[i] += 2e-3
        weight[row] = nudged.bfloat16()
    screen = GreedyHead.build(weight)
    assert screen is not None
    h = (base * 40).bfloat16().unsqueeze(0)
    assert screen.argmax(h) == full_greedy(h, weight)


@needs_kernel
def test_a_zero_row_gives_token_zero_like_the_full_head(isa: str) -> None:
    weight = head(1024, 64, seed=3)
    screen = GreedyHead.build(weight)
    assert screen is not None
    h = torch.zeros(1, 64, dtype=torch.bfloat16)
    assert screen.argmax(h) == full_greedy(h, weight) == 0


@needs_kernel
def test_the_screen_declines_when_too_many_rows_are_left(monkeypatch: pytest.MonkeyPatch, isa: str) -> None:
    monkeypatch.setattr(greedy_head, "MAX_PICKED", 4)
    weight = torch.ones(512, 64, dtype=torch.bfloat16)  # every logit equal: every row is left
    screen = GreedyHead.build(weight)
    assert screen is not None
    assert screen.argmax(torch.ones(1, 64, dtype=torch.bfloat16)) is None


@needs_kernel
def test_rows_it_does_not_take_are_declined(isa: str) -> None:
    weight = head(512, 64, seed=4)
    screen = GreedyHead.build(weight)
    assert screen is not None
    assert screen.argmax(torch.ones(2, 64, dtype=torch.bfloat16)) is None
    assert screen.argmax(torch.ones(1, 64, dtype=torch.float32)) is None
    assert screen.argmax(torch.full((1, 64), float("nan"), dtype=torch.bfloat16)) is None


def test_heads_it_cannot_screen_get_none() -> None:
    assert GreedyHead.build(head(512, 64, seed=5).float()) is None
    assert GreedyHead.build(head(512, 96, seed=5)) is None  # width not a multiple of 64
    assert GreedyHead.build(head(510, 64, seed=5)) is None  # rows not a multiple of 4


@needs_kernel
def test_chosen_rows_give_the_full_gemvs_values_bit_for_bit(isa: str) -> None:
    weight = head(1003, 640, seed=6)  # 1003 rows: the last block ends in single rows
    h = outlier_row(640, 7)
    full = full_logits(h, weight)
    rows = torch.tensor([0, 5, 998, 1000, 1001, 1002], dtype=torch.int64)
    picked = exact_rows(h, weight, rows)
    assert picked is not None
    assert torch.equal(picked, full[0, rows])


@needs_kernel
def test_a_model_decodes_greedily_through_the_screen_as_through_its_logits(tmp_path: Path, isa: str) -> None:
    directory = make_tiny_model("gemma3", tmp_path, seed=11)
    config = ModelConfig.from_hf(json.loads((directory / "config.json").read_text()))
    model = build_model(config, load_file(directory / "model.safetensors"), dtype=torch.bfloat16)
    screen = model.greedy_head
    assert screen is not None
    decided = []
    pool = KVPages.allocate(config, 40, 4, dtype=torch.bfloat16)
    table = list(range(40))
    tokens = [4 + (i * 37) % 300 for i in range(29)]
    start = 0
    for _ in range(12):
        h = model.hidden(ForwardBatch.build([(tokens[start:], start, table)]), pool)
        decided.append(screen.argmax(h))
        (token,) = model.greedy(h)
        assert token == int(greedy_tokens(model.logits(h))[0])
        start = len(tokens)
        tokens.append(token)
    assert all(t is not None for t in decided), "the screen should decide every step of this model"


@needs_kernel
def test_greedy_head_bench_smoke(tmp_path: Path) -> None:
    """bench/greedy_head.py runs on a tiny model and writes every figure (values not asserted)."""
    directory = make_tiny_model("gemma3", tmp_path / "model", seed=11)
    args = ["--model", str(directory), "--prompts", "1", "--prompt-tokens", "8", "--threads", "1"]
    code, figures = run_bench("greedy_head.py", args, tmp_path / "figures.json")
    assert code == 0
    assert {f["name"] for f in figures} >= {"one_row_greedy_token_ms_median", "mismatches"}
    assert all(set(f) == {"name", "value", "unit", "baseline", "baseline_value"} for f in figures)


needs_amx = pytest.mark.skipif(
    not (build.cpu_supports("amx") and head_screen.built()), reason="this CPU lacks AMX's int8 tiles"
)


@needs_amx
@pytest.mark.parametrize("rows", [1, 2, 8, 9, 17, 64])
def test_rows_screened_together_get_the_tokens_each_gets_alone(rows: int) -> None:
    seed = 1000 + rows
    print(f"seed {seed}")
    weight = head(8192, 640, seed)
    screen = GreedyHead.build(weight)
    assert screen is not None and screen.tiles is not None and screen.max_rows == 64
    h = torch.cat([outlier_row(640, seed * 100 + i) for i in range(rows)])
    tokens = screen.argmax_rows(h)
    assert tokens == [full_greedy(h[i : i + 1], weight) for i in range(rows)]
    assert screen.argmax(h[:1]) == tokens[0]


@needs_amx
def test_tied_maxima_give_the_lowest_id_in_a_batch_too() -> None:
    weight = head(4096, 128, seed=1)
    weight[3001] = weight[17] = weight[2500] * 4
    screen = GreedyHead.build(weight)
    assert screen is not None and screen.tiles is not None
    h = torch.cat([weight[2500:2501], head(1, 128, seed=9) * 30, weight[2500:2501]])
    tokens = screen.argmax_rows(h)
    assert tokens is not None and tokens[0] == tokens[2] == 17
    assert tokens[1] == full_greedy(h[1:2], weight)


@needs_amx
def test_a_batch_row_left_undecided_gets_its_token_from_the_full_logits(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    directory = make_tiny_model("gemma3", tmp_path, seed=11)
    config = ModelConfig.from_hf(json.loads((directory / "config.json").read_text()))
    model = build_model(config, load_file(directory / "model.safetensors"), dtype=torch.bfloat16)
    assert model.greedy_head is not None and model.greedy_head.max_rows > 1
    h = torch.cat([outlier_row(config.hidden_size, s) for s in range(5)])
    h[2] = 0  # every logit 0: every row is left for this one
    monkeypatch.setattr(greedy_head, "MAX_PICKED", 8)
    decided = model.greedy_head.argmax_rows(h)
    assert decided is not None and decided[2] is None and None not in decided[:2] + decided[3:]
    assert model.greedy(h) == greedy_tokens(model.logits(h)).tolist()


def test_without_amx_the_screen_takes_one_row(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(build.AMX_ENV, "0")
    build.clear_caches()
    try:
        screen = GreedyHead.build(head(1024, 64, seed=3))
        if screen is None:
            pytest.skip("the native kernels do not run here")
        assert screen.tiles is None and screen.q is not None and screen.max_rows == 1
        assert screen.argmax_rows(torch.ones(2, 64, dtype=torch.bfloat16)) is None
    finally:
        monkeypatch.undo()
        build.clear_caches()
