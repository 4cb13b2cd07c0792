"""``kvrelay bench scenarios``: run the scenario cases on a local cluster and write JSON, Markdown and plots.

Writes ``<out-dir>/scenarios.json`` (or ``--json PATH``), ``<out-dir>/scenarios.md``
and ``<out-dir>/scenarios_{ttft,itl,pages,bytes}.png``, and prints the case
table. A progress bar on stderr shows the requests sent so far. Exit code 0
when every case ran (whatever its figures), 1 when the cluster failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from kvrelay.launch import defaults
from kvrelay.models.dtypes import DTYPE_NAMES

DEFAULT_OUT = "bench/results"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", default=None, help="model directory or .gguf file (default: Gemma 3 270M)")
    add("--dtype", default=defaults.DTYPE, choices=DTYPE_NAMES, help=f"weights and KV dtype (default {defaults.DTYPE})")
    add("--requests", type=int, default=8, help="requests per case (default 8)")
    add("--concurrency", type=int, default=4, help="streams in flight at once in the cold to object cases (default 4)")
    add("--prefix-tokens", type=int, default=1536, help="tokens of each prefix (default 1536)")
    add("--suffix-tokens", type=int, default=64, help="tokens after the prefix (default 64)")
    add("--new-tokens", type=int, default=32, help="tokens generated per request (default 32)")
    add("--kv-tokens", type=int, default=8192, help="KV capacity per worker in tokens (default 8192)")
    add("--lanes", type=int, default=defaults.LANES, help=f"concurrent sequences per worker (default {defaults.LANES})")
    add("--ram-bytes", type=int, default=32 << 20, help="bytes of each worker's ram tier (default 32 MiB)")
    add(
        "--flood-factor",
        type=float,
        default=1.5,
        help="the flood before the ssd case sends this many times every worker's KV capacity (default 1.5)",
    )
    add("--seed", type=int, default=0, help="seed of the synthetic prompts (default 0)")
    add("--out-dir", default=DEFAULT_OUT, help=f"where the report and plots go (default {DEFAULT_OUT})")
    add("--json", default=None, metavar="PATH", help="the figures' JSON file (default <out-dir>/scenarios.json)")
    add(
        "--work-dir",
        default=None,
        help="directory for the cluster's database, chunks and log (default: a "
        "temporary directory, removed afterwards)",
    )
    add("--no-progress", action="store_true", help="no progress bar")


def _check(args: argparse.Namespace) -> str | None:
    if args.requests < 3:
        return f"--requests {args.requests}: at least 3 are needed (a third of them is cancelled)"
    for name in ("concurrency", "prefix_tokens", "suffix_tokens", "new_tokens", "kv_tokens", "lanes"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1"
    if args.prefix_tokens < 128 or args.prefix_tokens % 128:
        return f"--prefix-tokens {args.prefix_tokens} must be a multiple of 128 (two 64-token chunks per half)"
    return None


def run(args: argparse.Namespace) -> int:
    error = _check(args)
    if error is not None:
        print(f"kvrelay bench scenarios: {error}", file=sys.stderr)
        return 2
    import logging
    import shutil
    import tempfile
    import threading

    from kvrelay.bench.cluster import BenchCluster, ClusterError, ClusterSpec
    from kvrelay.bench.progress import ProgressBar
    from kvrelay.bench.scenarios.cases import ScenarioRunner, ScenarioSizes
    from kvrelay.bench.scenarios.prompts import ScenarioPrompts
    from kvrelay.launch.catalog import load_served_model

    for noisy in ("httpx", "httpx2", "httpcore", "openai"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    sizes = ScenarioSizes(
        args.requests,
        args.concurrency,
        args.prefix_tokens,
        args.suffix_tokens,
        args.new_tokens,
        args.flood_factor,
        args.seed,
    )
    work_dir = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="kvrelay-scenarios-"))
    spec = ClusterSpec(work_dir, args.model, args.dtype, args.kv_tokens, args.lanes, args.ram_bytes)
    vocab: list[int] = []
    failed: list[Exception] = []

    def load_vocab() -> None:
        try:
            vocab.append(len(load_served_model(args.model).tokenizer))
        except Exception as exc:  # noqa: BLE001 - reported below, by the main thread
            failed.append(exc)

    tokenizer = threading.Thread(target=load_vocab, name="load-tokenizer")
    tokenizer.start()
    bar = ProgressBar(sizes.total_requests(2, args.kv_tokens), enabled=not args.no_progress)
    cluster = BenchCluster(spec)
    started = time.monotonic()
    try:
        bar.update("starting the cluster", 0)
        cluster.start(["w1", "w2"])
        tokenizer.join()
        if failed:
            raise ClusterError(f"cannot load the tokenizer of {args.model or 'the default model'}: {failed[0]}")
        prompts = ScenarioPrompts(args.seed, vocab[0], args.requests, args.prefix_tokens, args.suffix_tokens)
        runner = ScenarioRunner(cluster, sizes, prompts, bar.update)
        summaries = runner.run()
        samples = runner.sampler.samples
    except ClusterError as exc:
        bar.close()
        print(f"kvrelay bench scenarios: {exc}", file=sys.stderr)
        return 1
    finally:
        cluster.close()
        if not args.work_dir:
            shutil.rmtree(work_dir, ignore_errors=True)
    bar.close()
    _write_outputs(args, summaries, samples, time.monotonic() - started)
    return 0


def _write_outputs(args: argparse.Namespace, summaries: list[Any], samples: list[Any], wall_s: float) -> None:
    """The JSON figures, the plots and the Markdown report; the case table on stdout."""
    import json
    import platform

    from kvrelay.bench.scenarios.plots import write_plots
    from kvrelay.bench.scenarios.report import case_table, figures, markdown

    out_dir = Path(args.out_dir)
    figure_list = figures(summaries)
    json_path = Path(args.json) if args.json else out_dir / "scenarios.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(figure_list, indent=1) + "\n")
    plots = write_plots(summaries, samples, out_dir, "scenarios")
    given = sys.argv[sys.argv.index("scenarios") + 1 :] if "scenarios" in sys.argv else []
    header = {
        "command": f"`flock /tmp/kvrelay-bench.lock .venv/bin/kvrelay bench scenarios {' '.join(given)}`".replace(
            " `", "`"
        ),
        "model": args.model or "Gemma 3 270M (default)",
        "dtype": args.dtype,
        "sizes": f"{args.requests} requests per case, concurrency {args.concurrency}, prefix {args.prefix_tokens} "
        f"+ suffix {args.suffix_tokens} tokens, {args.new_tokens} new tokens, {args.kv_tokens} KV tokens "
        f"and {args.lanes} lanes per worker, ram tier {args.ram_bytes >> 20} MiB, seed {args.seed}",
        "cluster": "router + 2 worker processes, SQLite fact store, local ssd tier per worker, S3 object tier on "
        "moto_server",
        "machine": f"{platform.machine()}, {_cores()} cores, Python {platform.python_version()}, "
        f"{platform.system()} {platform.release()}",
        "wall time": f"{wall_s:.0f} s",
        "load average at the end (1, 5, 15 min)": ", ".join(f"{v:.1f}" for v in os.getloadavg()),
    }
    (out_dir / "scenarios.md").write_text(markdown(summaries, header, plots, figure_list))
    print("\n".join(case_table(summaries)))
    print(f"\nwrote {json_path}, {out_dir / 'scenarios.md'} and {len(plots)} plots")


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
