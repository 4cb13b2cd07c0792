"""How much a prefill on one vLLM engine slows a prefill on another engine of the same host.

Two vLLM servers of the same model on this machine (``kvrelay.bench.trace.vllm_engines.shared_engines``, one torch
thread each, as ``bench/real_routers.py`` runs them). Engine A gets cold prompts of ``--long`` tokens (random token
ids, one output token: the time to first token is the prefill) in three cases, ``--reps`` times each, alternating:

- ``alone``: engine B idle (the baseline);
- ``beside_N``: engine B prefilling cold prompts of N tokens back to back meanwhile, for each N of ``--beside``.

Figures: the median TTFT of each case, and each case's median over the baseline's. On a 2-core host this is
what one engine's work costs a request on the other, which no router's choice of the second engine sees
(docs/performance.md, "Engines on one host slow each other").

    .venv/bin/python bench/engine_interference.py [--model DIR|default] [--reps 5] [--json PATH]   # about 4 minutes
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from kvrelay.bench.report import Figure, report


def cold_prompt(rng: random.Random, tokens: int) -> list[int]:
    """Random token ids: no prefix of one is cached from another."""
    return [rng.randrange(1000, 200_000) for _ in range(tokens)]


def ttft(client: httpx.Client, url: str, model: str, prompt: list[int]) -> float:
    """Seconds from sending a one-token streamed completion to its first text chunk."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "stream": True, "temperature": 0}
    started = time.perf_counter()
    with client.stream("POST", url + "/v1/completions", json=body) as answer:
        answer.raise_for_status()
        for line in answer.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                break
    return time.perf_counter() - started


def beside(
    url: str, model: str, tokens: int, rng: random.Random, started: threading.Event, stop: threading.Event
) -> None:
    """Cold prompts of ``tokens`` to ``url`` back to back until ``stop``; ``started`` once the first is sent."""
    with httpx.Client(timeout=120) as client:
        while not stop.is_set():
            prompt = cold_prompt(rng, tokens)
            started.set()
            ttft(client, url, model, prompt)


def main() -> None:
    from kvrelay.bench.trace.vllm_engines import real_model, shared_engines
    from kvrelay.models.loading.loader import model_directory

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="model directory vLLM serves (default: Gemma 3 270M)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--long", type=int, default=2049, help="prompt tokens on engine A")
    parser.add_argument("--beside", default="578,2049", help="prompt tokens on engine B, comma-separated cases")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    model_dir = model_directory(None if args.model == "default" else args.model)
    rng = random.Random(args.seed)
    print(f"seed {args.seed}; starting 2 vLLM servers of {model_dir} ...", flush=True)
    cases = ["alone", *(f"beside_{n}" for n in args.beside.split(","))]
    times: dict[str, list[float]] = {case: [] for case in cases}
    with tempfile.TemporaryDirectory(prefix="kvrelay-interference-") as logs:
        real = real_model(model_dir, args.dtype, 4096)
        with shared_engines(model_dir, 2, 256, Path(logs), real) as engines, httpx.Client(timeout=120) as client:
            a, b = (e.spec.url for e in engines)
            name = engines[0].spec.served_name or model_dir.name
            for url in (a, b):
                ttft(client, url, name, cold_prompt(rng, 300))  # warm each engine once
            for _ in range(args.reps):
                for case in cases:
                    if case == "alone":
                        times[case].append(ttft(client, a, name, cold_prompt(rng, args.long)))
                        continue
                    started, stop = threading.Event(), threading.Event()
                    other = random.Random(rng.random())
                    worker = threading.Thread(
                        target=beside, args=(b, name, int(case.split("_")[1]), other, started, stop)
                    )
                    worker.start()
                    started.wait(30)
                    times[case].append(ttft(client, a, name, cold_prompt(rng, args.long)))
                    stop.set()
                    worker.join(120)
    base = statistics.median(times["alone"])
    figures = [Figure(f"ttft_{args.long}_alone", base, "s")]
    for case in cases[1:]:
        value = statistics.median(times[case])
        figures.append(Figure(f"ttft_{args.long}_{case}", value, "s", "alone", base))
        figures.append(Figure(f"slowdown_{case}", value / base, "x", "alone", 1.0))
    report(
        f"a {args.long}-token prefill on one vLLM engine while the other works ({args.reps} reps)", figures, args.json
    )


if __name__ == "__main__":
    main()
