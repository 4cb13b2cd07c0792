"""What an exact continuation costs on one worker's runtime: replaying delivered tokens against prefilling them.

One engine (Gemma 3 270M in bfloat16 by default, the worker's defaults: 16 lanes, a
512-token budget) keeps ``--background`` streams decoding. For each count ``D`` of
``--delivered`` tokens, a continuation job (a 32-token prompt plus ``D`` delivered
tokens) is submitted twice per round, once replaying the delivered tokens as decode
rows (``Job.replay = D``, the default) and once prefilling them (``replay=0``, the path
before), the order flipping each round. Figures per ``D``: the continuation's time to
first token from submission (median over rounds) in both modes, and the background
streams' decode rate while the continuation runs its first token, replay against
prefill.

Run: ``flock /tmp/kvrelay-bench.lock .venv/bin/python bench/replay_cost.py --json
bench/results/replay_cost.json``
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from kvrelay.bench.report import Figure, report
from kvrelay.launch import defaults
from kvrelay.protocol.messages import Sampling
from kvrelay.worker.runtime.engine import Engine, EngineOptions
from kvrelay.worker.runtime.jobs import Job, RuntimeEvent, TokenEvent

PROMPT = 32


class Background:
    """Streams that decode until stopped, counting their tokens."""

    def __init__(self, engine: Engine, count: int, ids: tuple[int, int]) -> None:
        self.engine = engine
        self.tokens = 0
        self.lock = threading.Lock()
        gen = torch.Generator().manual_seed(5)
        self.handles = []
        for _ in range(count):
            prompt = tuple(torch.randint(ids[0], ids[1], (PROMPT,), generator=gen).tolist())
            pages = engine.allocate_pages(PROMPT + 4000)
            job = Job(prompt, tuple(pages), max_new_tokens=3999, sampling=Sampling())
            self.handles.append(engine.runtime.submit(job, self._count))

    def _count(self, event: RuntimeEvent) -> None:
        if isinstance(event, TokenEvent):
            with self.lock:
                self.tokens += 1

    def count(self) -> int:
        with self.lock:
            return self.tokens

    def stop(self) -> None:
        for handle in self.handles:
            handle.cancel()
        for handle in self.handles:
            handle.result(60)


def continuation_ttft(
    engine: Engine, background: Background, tokens: tuple[int, ...], delivered: int, replay: bool
) -> tuple[float, float]:
    """Seconds from submitting the continuation to its first token, and the background's tokens per second then."""
    pages = engine.allocate_pages(len(tokens) + 2)
    job = Job(tokens, tuple(pages), max_new_tokens=1, sampling=Sampling(), replay=delivered if replay else 0)
    before = background.count()
    started = time.perf_counter()
    engine.runtime.submit(job).result(600)
    took = time.perf_counter() - started
    rate = (background.count() - before) / took
    engine.free_pages(pages)
    return took, rate


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model directory or .gguf (default: Gemma 3 270M)")
    p.add_argument("--delivered", type=int, nargs="+", default=[16, 48, 96, 192])
    p.add_argument("--background", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ids", type=int, nargs=2, default=(1000, 30000), help="token ids are drawn from [LO, HI)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    options = EngineOptions(kv_tokens=65536, num_lanes=defaults.LANES, token_budget=defaults.TOKEN_BUDGET)
    engine = Engine.open(args.model, defaults.DTYPE, options)
    ids = (args.ids[0], args.ids[1])
    gen = torch.Generator().manual_seed(9)
    results: dict[tuple[int, bool], list[tuple[float, float]]] = {}
    try:
        background = Background(engine, args.background, ids)
        try:
            for r in range(args.rounds):
                for delivered in args.delivered:
                    tokens = tuple(torch.randint(ids[0], ids[1], (PROMPT + delivered,), generator=gen).tolist())
                    modes = [True, False] if (r + delivered) % 2 == 0 else [False, True]
                    for replay in modes:
                        took = continuation_ttft(engine, background, tokens, delivered, replay)
                        results.setdefault((delivered, replay), []).append(took)
                        print(
                            f"round {r + 1}, D {delivered}, {'replay' if replay else 'prefill'}: "
                            f"{took[0]:.3f} s, background {took[1]:.1f} tok/s",
                            flush=True,
                        )
        finally:
            background.stop()
    finally:
        engine.close()
    figures = []
    for delivered in args.delivered:
        replayed = results[(delivered, True)]
        prefilled = results[(delivered, False)]
        ratios = sorted(a[0] / b[0] for a, b in zip(replayed, prefilled, strict=True))
        print(
            f"D {delivered}: replay / prefill TTFT median {statistics.median(ratios):.2f} "
            f"(min {ratios[0]:.2f}, max {ratios[-1]:.2f})"
        )
        figures += [
            Figure(
                f"ttft_d{delivered}_s",
                statistics.median(t for t, _ in replayed),
                "s",
                "prefill",
                statistics.median(t for t, _ in prefilled),
            ),
            Figure(f"ttft_ratio_d{delivered}", statistics.median(ratios), "x"),
            Figure(
                f"background_tok_s_d{delivered}",
                statistics.median(r for _, r in replayed),
                "tok/s",
                "prefill",
                statistics.median(r for _, r in prefilled),
            ),
        ]
    report(f"exact continuation cost on one runtime ({args.background} streams decoding beside it)", figures, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
