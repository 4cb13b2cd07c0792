"""Measure one worker's costs on this machine and write them as a calibration file for ``kvrelay sim``.

Through the real paged runtime (``worker.runtime.engine.Engine``) with the real model
(default Gemma 3 270M, bfloat16), ``--threads`` torch threads (1: one core per
worker process, as in ``bench/trace_e2e.py``), ``--lanes`` lanes and a token
budget of ``--token-budget`` (the worker's defaults):

- prefill seconds per token: the slope of a least-squares line through the time
  to first token of single prompts of 64 .. ``token_budget`` tokens (one
  iteration each; median of ``--repeats``); its intercept is
  ``prefill_forward_s``, the fixed cost of a forward that only prefills;
- decode seconds per step at batch sizes 1 .. ``lanes``: ``B`` sequences of
  ``--decode-context`` prompt tokens are submitted together; once all of them
  decode, the gaps between consecutive tokens of one sequence are the step
  times (median); batch sizes not measured (``--decode-batches``) are linearly
  interpolated;
- the CPU availability while measuring: the share of the process's runnable
  time its threads actually ran (``/proc`` schedstat: run / (run + run-queue
  wait)), so a replay under other CPU load can scale these costs;
- restore bytes per second per tier: read from ``bench/results/restore.json``
  (``bench/restore.py``, measured on this machine: ram = ``ram_verified``, ssd =
  ``ssd_dropped_verified``, object = ``s3_verified``; peer is not measured there
  and is left out, so the cluster config's value stays).

Optionally (``--co-runners N``, default 0) the measurements run next to N
sibling processes that keep one more engine busy ``--co-runner-duty`` (0.5) of
the time (rounds of 4 concurrent
512-token prompts with 16 new tokens each, each round followed by an idle
spell): the costs include a sibling worker's share of cores, memory bandwidth
and caches, as a worker sees them in the cluster. By default the costs are
measured alone and ``bench/trace_e2e.py`` scales them by the CPU availability
(below) its workers had during the replays, which covers the sibling worker,
the router and every other process competing for the cores.

Writes TOML (``--out``, default ``configs/calibration-gemma3-270m-cpu.toml``)
in the format of ``sim.calibration``, and prints the figures.

Run: ``flock /tmp/kvrelay-bench.lock .venv/bin/python bench/calibrate.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import UTC, datetime
from itertools import pairwise
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_OUT = ROOT / "configs" / "calibration-gemma3-270m-cpu.toml"
RESTORE_FIGURES = {"ram": "ram_verified", "ssd": "ssd_dropped_verified", "object": "s3_verified"}


def prompt(n: int, salt: int, vocab: int) -> list[int]:
    return [(1000 + salt * 7919 + i * 104729) % (vocab - 1000) + 1000 for i in range(n)]


def time_to_first_token(engine, ids: list[int]) -> float:
    from kvrelay.protocol.messages import Sampling

    started = time.perf_counter()
    engine.generate(ids, 1, Sampling())
    return time.perf_counter() - started


def decode_step(engine, batch: int, context: int, steps: int, vocab: int) -> float:
    """Median seconds between consecutive tokens of one sequence while all ``batch`` sequences decode."""
    from kvrelay.protocol.messages import Sampling
    from kvrelay.worker.runtime.jobs import Job, JobResult, TokenEvent

    times: dict[int, list[float]] = {}
    pages = [engine.allocate_pages(context + steps) for _ in range(batch)]
    handles = []

    def on_event(event: TokenEvent | JobResult) -> None:
        if isinstance(event, TokenEvent):
            times.setdefault(event.job_id, []).append(time.perf_counter())

    for i in range(batch):
        job = Job(tuple(prompt(context, 100 + i, vocab)), tuple(pages[i]), max_new_tokens=steps, sampling=Sampling())
        handles.append(engine.runtime.submit(job, on_event))
    for h in handles:
        h.result(600)
    for p in pages:
        engine.free_pages(p)
    all_decoding = max(ts[0] for ts in times.values())
    gaps = [b - a for ts in times.values() for a, b in pairwise(ts) if a >= all_decoding]
    return median(gaps)


def background_load(args: argparse.Namespace) -> None:
    """A sibling worker's steady load, until killed: rounds of 4 concurrent prompts with 16 new tokens each."""
    import torch

    from kvrelay.protocol.messages import Sampling
    from kvrelay.worker.runtime.engine import Engine, EngineOptions
    from kvrelay.worker.runtime.jobs import Job

    torch.set_num_threads(args.threads)
    with Engine.open(
        args.model, args.dtype, EngineOptions(kv_tokens=16384, num_lanes=args.lanes, token_budget=args.token_budget)
    ) as engine:
        vocab = engine.artifacts.config.vocab_size
        print("background load ready", flush=True)
        salt = 0
        while True:
            started = time.perf_counter()
            pages = [engine.allocate_pages(512 + 16) for _ in range(4)]
            handles = [
                engine.runtime.submit(
                    Job(tuple(prompt(512, 10_000 + salt + i, vocab)), tuple(p), max_new_tokens=16, sampling=Sampling())
                )
                for i, p in enumerate(pages)
            ]
            for h, p in zip(handles, pages):
                h.result(600)
                engine.free_pages(p)
            salt += 4
            busy = time.perf_counter() - started
            time.sleep(busy * (1.0 - args.co_runner_duty) / max(args.co_runner_duty, 1e-3))


def start_co_runners(args: argparse.Namespace) -> list:
    import subprocess

    argv = [
        sys.executable,
        __file__,
        "--background-load",
        "--threads",
        str(args.threads),
        "--dtype",
        args.dtype,
        "--co-runner-duty",
        str(args.co_runner_duty),
        "--lanes",
        str(args.lanes),
        "--token-budget",
        str(args.token_budget),
        *(["--model", args.model] if args.model else []),
    ]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) for _ in range(args.co_runners)]
    for p in procs:
        assert p.stdout is not None
        if "ready" not in p.stdout.readline():
            raise RuntimeError("a co-runner did not start; run with --co-runners 0 to measure alone")
    return procs


def interpolate(points: dict[int, float], upto: int) -> list[float]:
    xs = sorted(points)
    out = []
    for b in range(1, upto + 1):
        if b in points:
            out.append(points[b])
            continue
        lo = max((x for x in xs if x < b), default=xs[0])
        hi = min((x for x in xs if x > b), default=xs[-1])
        out.append(points[lo] if hi == lo else points[lo] + (points[hi] - points[lo]) * (b - lo) / (hi - lo))
    return out


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


def restore_rates(path: Path) -> dict[str, float]:
    if not path.is_file():
        return {}
    figures = {f["name"]: f for f in json.loads(path.read_text())}
    return {tier: figures[name]["value"] * 1e9 for tier, name in RESTORE_FIGURES.items() if name in figures}


def toml_text(values: dict, measured: dict) -> str:
    def fmt(v: object) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, float):
            return f"{v:.6g}"
        if isinstance(v, list):
            return "[" + ", ".join(fmt(x) for x in v) + "]"
        return str(v)

    lines = [
        "# Measured costs of one kvrelay worker on this machine, for `kvrelay sim --calibration` (issue 9).",
        "# Written by bench/calibrate.py; see its docstring for how each figure is measured.",
        "",
    ]
    lines += [f"{k} = {fmt(v)}" for k, v in values.items() if not isinstance(v, dict)]
    for section in ("worker", "network"):
        table = values.get(section, {})
        lines += ["", f"[{section}]"] + [f"{k} = {fmt(v)}" for k, v in table.items() if not isinstance(v, dict)]
        for sub, inner in ((k, v) for k, v in table.items() if isinstance(v, dict)):
            lines += ["", f"[{section}.{sub}]"] + [f"{k} = {fmt(v)}" for k, v in inner.items()]
    lines += ["", "[measured]"] + [f"{k} = {fmt(v)}" for k, v in measured.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory or GGUF (default: Gemma 3 270M)")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lanes", type=int, default=16)
    parser.add_argument("--token-budget", type=int, default=512)
    parser.add_argument("--kv-tokens", type=int, default=65536, help="KV capacity per worker (the sim's gpu tier)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-context", type=int, default=256)
    parser.add_argument("--decode-steps", type=int, default=10)
    parser.add_argument("--decode-batches", default="1,2,4,8,12,16")
    parser.add_argument("--workers", type=int, default=2, help="workers of the calibrated cluster")
    parser.add_argument("--restore-json", type=Path, default=ROOT / "bench" / "results" / "restore.json")
    parser.add_argument("--co-runners", type=int, default=0, help="sibling engines kept busy while measuring")
    parser.add_argument("--co-runner-duty", type=float, default=0.5, help="share of time a co-runner is busy")
    parser.add_argument("--background-load", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.background_load:
        background_load(args)
        return 0

    import torch

    from kvrelay.bench.trace.faces import sched_of
    from kvrelay.models.loading.loader import load_artifacts
    from kvrelay.worker.runtime.engine import Engine, EngineOptions, parse_dtype
    from kvrelay.worker.runtime.torch_threads import confine_threads

    torch.set_num_threads(args.threads)
    confine_threads()  # before loading: the runtime's device thread alone runs torch ops in parallel
    dtype = parse_dtype(args.dtype)
    artifacts = load_artifacts(args.model, dtype=dtype)
    cfg = artifacts.config
    vocab = cfg.vocab_size
    options = EngineOptions(
        kv_tokens=max(args.kv_tokens // 4, 16384), num_lanes=args.lanes, token_budget=args.token_budget
    )
    lengths = [n for n in (64, 128, 256, 384, 512) if n <= args.token_budget]
    co_runners = start_co_runners(args)
    sched_before = sched_of(os.getpid())
    try:
        with Engine.from_artifacts(artifacts, dtype, options) as engine:
            time_to_first_token(engine, prompt(64, 0, vocab))  # warm-up
            samples: dict[int, list[float]] = {n: [] for n in lengths}
            for r in range(args.repeats):  # interleaved, so slow spells of the machine spread over the lengths
                for n in lengths:
                    samples[n].append(time_to_first_token(engine, prompt(n, r + 1, vocab)))
            ttft = {n: median(v) for n, v in samples.items()}
            slope, intercept = fit_line([float(n) for n in lengths], [ttft[n] for n in lengths])
            batches = sorted({int(b) for b in args.decode_batches.split(",") if 0 < int(b) <= args.lanes})
            steps = {b: decode_step(engine, b, args.decode_context, args.decode_steps, vocab) for b in batches}
        run, wait = (after - before for after, before in zip(sched_of(os.getpid()), sched_before))
    finally:
        for p in co_runners:
            p.kill()
            p.wait()
    table = interpolate(steps, args.lanes)
    rates = restore_rates(args.restore_json)
    for n in lengths:
        print(f"prefill {n:5d} tokens: {ttft[n] * 1e3:8.1f} ms")
    print(f"prefill slope {slope * 1e3:.4f} ms/token, intercept {intercept * 1e3:.1f} ms")
    for b in batches:
        print(f"decode step at batch {b:2d}: {steps[b] * 1e3:8.1f} ms")
    print(f"CPU availability while measuring: {run / (run + wait):.2f} (ran {run:.1f} s, waited {wait:.1f} s)")
    print("restore bytes/s:", {k: f"{v:.3g}" for k, v in rates.items()} or "none (no restore.json)")
    values: dict = {
        "workers": args.workers,
        "model": artifacts.name,
        "kv_bytes_per_token": cfg.kv_bytes_per_token(torch.finfo(dtype).bits // 8),
        "page_tokens": 16,
        "chunk_tokens": 64,
        "heartbeat_interval_s": 0.5,
        "object_write_through": False,
        "worker": {
            "gpu_kv_tokens": args.kv_tokens,
            "max_lanes": args.lanes,
            "prefill_s_per_token": slope,
            "prefill_forward_s": max(0.0, intercept),
            "prefill_chunk_tokens": args.token_budget,
            "decode_step_s": table[0],
            "decode_step_s_per_lane": 0.0,
            "decode_step_table_s": table,
            "context_limit": cfg.max_position_embeddings,
            **({"restore_bytes_per_s": rates} if rates else {}),
        },
    }
    measured = {
        "command": ("bench/calibrate.py " + " ".join(argv if argv is not None else sys.argv[1:])).replace(
            str(ROOT) + os.sep, ""
        ),
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cpus".strip(),
        "torch": torch.__version__,
        "dtype": args.dtype,
        "threads": args.threads,
        "prefill_ttft_s": [ttft[n] for n in lengths],
        "prefill_lengths": lengths,
        "decode_batches": batches,
        "decode_context_tokens": args.decode_context,
        "co_runners": args.co_runners,
        "co_runner_duty": args.co_runner_duty,
        "cpu_availability": run / (run + wait) if run + wait > 0 else 1.0,
        "restore_source": str(args.restore_json.relative_to(ROOT)) if rates else "none",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(toml_text(values, measured), encoding="utf-8")
    from kvrelay.sim.calibration import load_calibration

    load_calibration(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
