"""The greedy token of one row: the int8 screen of ``models.greedy_head`` against the full bfloat16 LM head.

The rows are real: the final normed hidden rows of ``--prompts`` (8) prompts of
``--prompt-tokens`` (64) random tokens, one per position, through the model
(default Gemma 3 270M, bfloat16). For each row, on the same thread, the full head
(``native.linear_row``'s GEMV over every row of the head, then ``greedy_tokens``)
and the screen (``GreedyHead.argmax``), alternating; the figures are the median
and mean times over all rows (a declined row is charged the screen and then the
full head, as the runtime pays them), and how many head rows the screen
left for exact logits. Every
screened token is checked against the full head's (``mismatches`` must be 0).

Run: ``.venv/bin/python bench/greedy_head.py --json bench/results/greedy_head.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from kvrelay.bench.report import Figure, report
from kvrelay.models.batch import ForwardBatch
from kvrelay.models.kernels.kv_pages import KVPages
from kvrelay.models.kernels.native.linear_row import linear_row_native
from kvrelay.models.loading.loader import load_artifacts
from kvrelay.models.registry import build_model
from kvrelay.models.sampling import greedy_tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--model", default=None, help="model directory or GGUF (default: Gemma 3 270M)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    artifacts = load_artifacts(args.model, dtype=torch.bfloat16)
    config = artifacts.config
    model = build_model(config, artifacts.weights, dtype=torch.bfloat16)
    screen = model.greedy_head
    if screen is None:
        print("the greedy screen does not run here (no AVX-512 BF16/VNNI, no C compiler, or another head shape)")
        return 1
    page_tokens = 16
    pages = -(-args.prompt_tokens // page_tokens)
    kv = KVPages.allocate(config, pages, page_tokens, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(args.prompts):
        prompt = torch.randint(4, config.vocab_size, (args.prompt_tokens,), generator=gen).tolist()
        batch = ForwardBatch.build([(prompt, 0, list(range(pages)))], logits="all")
        rows += list(model.hidden(batch, kv).split(1))
    full_ms, screen_ms, left, mismatches, declined = [], [], [], 0, 0
    for h in rows:
        start = time.perf_counter()
        logits = linear_row_native(h, model.lm_head)
        want = int(greedy_tokens(logits if logits is not None else model.logits(h))[0])
        middle = time.perf_counter()
        got = screen.argmax(h)
        end = time.perf_counter()
        full_ms.append((middle - start) * 1e3)
        screen_ms.append((end - middle + (middle - start if got is None else 0.0)) * 1e3)
        declined += got is None
        mismatches += got is not None and got != want
        if got is not None:
            left.append(screen.last_left)
    baseline = "full bfloat16 head (C GEMV) + greedy_tokens"
    figures = [
        Figure(
            "one_row_greedy_token_ms_median", statistics.median(screen_ms), "ms", baseline, statistics.median(full_ms)
        ),
        Figure("one_row_greedy_token_ms_mean", statistics.mean(screen_ms), "ms", baseline, statistics.mean(full_ms)),
        Figure(
            "rows_left_for_exact_logits_median",
            statistics.median(left) if left else 0.0,
            "rows",
            "head rows",
            config.vocab_size,
        ),
        Figure("rows_screened", len(rows), "rows", None, None),
        Figure("declined", declined, "rows", None, None),
        Figure("mismatches", mismatches, "rows", None, None),
    ]
    report(f"{artifacts.name}, one row, {args.threads} threads, bfloat16", figures, args.json)
    return 0 if mismatches == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
