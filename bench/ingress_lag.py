"""Event-loop lag while a huge prompt is prepared: on the loop itself, on a thread, or on a process pool.

What the ingress does with a huge request (``api.ingress._encode`` on a text of
``--text-bytes``; transformers' ``apply_chat_template`` then the encoder on a chat
of ``--turns`` alternating turns) runs once per place per round, rounds
alternating the places: on the event loop, on a thread of a pool (what the
ingress does), on a process pool whose processes loaded the tokenizer once
(``--processes``). A ticker on the loop sleeps 5 ms at a time; its lateness is the
loop's lag. The figures are, per workload and place, the worst lag and the
time the work took, as medians over ``--rounds`` rounds. Model: default Gemma 3
270M's tokenizer (``--model`` names another source).

Run: ``flock /tmp/kvrelay-bench.lock .venv/bin/python bench/ingress_lag.py --json bench/results/ingress_lag.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any

from kvrelay.bench.report import Figure, report
from kvrelay.launch.catalog import load_served_model

TICK_S = 0.005
_TOKENIZER: Any = None


def load(source: str | None) -> None:
    global _TOKENIZER
    _TOKENIZER = load_served_model(source).tokenizer


def encode(text: str) -> int:
    return len(_TOKENIZER.backend_tokenizer.encode_batch([text], add_special_tokens=True)[0].ids)


def chat(turns: int) -> int:
    message = "All work and no play makes Jack a dull boy."
    messages = [{"role": ("user", "assistant")[i % 2], "content": message} for i in range(turns)]
    text = _TOKENIZER.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(_TOKENIZER.backend_tokenizer.encode_batch([text], add_special_tokens=False)[0].ids)


async def measure(work: Callable[[Any], int], arg: Any, pool: Executor | None) -> tuple[float, float]:
    """(seconds the work took, the loop's worst lag in seconds) with the work on the loop (``pool`` None) or a pool."""
    done = asyncio.Event()
    lags: list[float] = []

    async def ticker() -> None:
        while not done.is_set():
            started = time.perf_counter()
            await asyncio.sleep(TICK_S)
            lags.append(time.perf_counter() - started - TICK_S)

    ticking = asyncio.create_task(ticker())
    await asyncio.sleep(0.1)
    started = time.perf_counter()
    if pool is None:
        work(arg)
    else:
        await asyncio.get_running_loop().run_in_executor(pool, work, arg)
    took = time.perf_counter() - started
    done.set()
    await ticking
    return took, max(lags)


async def run(args: argparse.Namespace) -> list[Figure]:
    load(args.model)
    places: dict[str, Executor | None] = {
        "loop": None,
        "thread": ThreadPoolExecutor(4),
        "process": ProcessPoolExecutor(args.processes, initializer=load, initargs=(args.model,)),
    }
    loop = asyncio.get_running_loop()
    await asyncio.gather(*(loop.run_in_executor(places["process"], encode, "warm") for _ in range(args.processes)))
    workloads: dict[str, tuple[Callable[[Any], int], Any]] = {
        f"encode {args.text_bytes:,} bytes": (encode, "All work and no play. " * (args.text_bytes // 22)),
        f"chat of {args.turns:,} turns": (chat, args.turns),
    }
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        for workload, (work, arg) in workloads.items():
            for place, pool in places.items():
                results.setdefault((workload, place), []).append(await measure(work, arg, pool))
    for pool in places.values():
        if pool is not None:
            pool.shutdown()
    figures = []
    for (workload, place), runs in results.items():
        lag = statistics.median(lag for _, lag in runs) * 1000
        took = statistics.median(took for took, _ in runs)
        loop_lag = statistics.median(lag for _, lag in results[(workload, "loop")]) * 1000
        figures.append(Figure(f"{workload}, {place}: worst loop lag", lag, "ms", "on the loop", loop_lag))
        figures.append(Figure(f"{workload}, {place}: time", took, "s"))
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--model", default=None, help="model source whose tokenizer is used (default: Gemma 3 270M)")
    parser.add_argument("--text-bytes", type=int, default=1_000_000)
    parser.add_argument("--turns", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--processes", type=int, default=2)
    args = parser.parse_args(argv)
    report("event-loop lag while a huge prompt is prepared", asyncio.run(run(args)), args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
