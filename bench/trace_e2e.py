"""A slice of a Mooncake trace replayed end to end through real servers: kvrelay's router against peers.

The slice (``--offset``, ``--count``: requests in timestamp order; default the
trace's last 80) is replayed open loop over HTTP (streamed ``/v1/completions``,
greedy) against each setup in turn, on the same machine, each setup starting
cold, ``--rounds`` (2) times in alternating order (A B C, C B A) with the
samples pooled, because other processes on a shared machine take a varying
share of the CPU (the workers' CPU availability per replay is reported):

1. ``kvrelay``: ``kvrelay cluster --workers 2`` (router process + 2 worker
   processes), router policy ``kvrelay`` (predicted TTFT);
2. ``sglang_cache_aware``: PyPI ``sglang-router`` ``--policy cache_aware`` (its
   defaults otherwise) in front of 2 ``kvrelay serve`` processes, each a plain
   OpenAI HTTP face of one worker (left out, and said so, when sglang-router is
   not installed: ``make routers``);
3. ``round_robin``: the same ``kvrelay cluster`` with the router policy
   ``round_robin`` (kvrelay's router, so it differs from 1 only by the policy).

Scaling (``kvrelay.bench.trace.prompts``): a trace block of 512 tokens becomes
``--block-tokens`` (16) tokens of single-token words (equal hash ids give equal
token blocks), prompts are capped at ``--max-prompt-tokens`` (2048), outputs at
``--max-output-tokens`` (16), and arrival times are stretched ``--time-stretch``
times (2.0: half the trace's request rate), so the load on 2 CPU workers of
Gemma 3 270M (bf16, one torch thread per process) resembles a busy cluster's.

Figures: TTFT p50/p90/p99, requests/s and output tokens/s over the makespan,
and prompt tokens served from cache (usage ``prompt_tokens_details.cached_tokens``),
kvrelay against each baseline; then the simulator's prediction (``kvrelay sim``
costs from ``--calibration``, same prompts and arrivals, 2 workers, kvrelay
policy) against the measured kvrelay TTFT at p50, p90 and p99, as the relative
error of each (goal: within 9 %, the median latency error BLIS publishes;
``--setups kvrelay`` measures that alone).
Also writes a Markdown table (``--md``), a TTFT CDF (``--png``) and the
per-request measurements (``--requests-json``).

Run: ``flock /tmp/kvrelay-bench.lock .venv/bin/python bench/trace_e2e.py --json bench/results/trace_e2e.json``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from kvrelay.bench.trace.client import Measured, replay, wait_ready, warm_up
from kvrelay.bench.trace.decisions import routing_summary
from kvrelay.bench.trace.faces import (
    CLUSTER_READY,
    FaceOptions,
    kvrelay_cluster,
    serve_workers,
    start_peer,
    until,
)
from kvrelay.bench.trace.peers import Peer, find_peer
from kvrelay.bench.trace.prompts import Scaling, TracePrompt, slice_prompts
from kvrelay.bench.trace.report import (
    calibration_figures,
    comparison_figures,
    markdown,
    plot_cdf,
    summarize,
)

ROOT = Path(__file__).resolve().parents[1]

TRACE = ROOT / "data" / "traces" / "mooncake_synthetic_trace.jsonl"
SETUPS = ("kvrelay", "sglang_cache_aware", "round_robin")
LABELS = {
    "kvrelay": "kvrelay router (policy kvrelay)",
    "sglang_cache_aware": "sglang-router cache_aware over 2 kvrelay serve",
    "round_robin": "kvrelay router (policy round_robin)",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument(
        "--offset",
        type=int,
        default=3913,
        help="first request of the slice (timestamp order; default: the trace's last 80, where 67%% of "
        "prompt tokens are prefixes seen earlier in the slice)",
    )
    p.add_argument("--count", type=int, default=80, help="requests in the slice")
    p.add_argument("--block-tokens", type=int, default=16, help="tokens per trace block here (the trace's: 512)")
    p.add_argument("--max-prompt-tokens", type=int, default=2048)
    p.add_argument("--max-output-tokens", type=int, default=16)
    p.add_argument("--time-stretch", type=float, default=2.0, help="wall seconds per trace second")
    p.add_argument("--model", default=None, help="model directory or GGUF (default: Gemma 3 270M)")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--kv-tokens", type=int, default=65536)
    p.add_argument("--lanes", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker process")
    p.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated subset of {', '.join(SETUPS)}")
    p.add_argument(
        "--routers-venvs", type=Path, default=None, help="where `make routers` installed the peers (.venv-routers)"
    )
    p.add_argument(
        "--calibration",
        default="measure",
        help="'measure': run bench/calibrate.py now (same model, dtype, threads, lanes) into "
        "--calibration-out and predict with it; a path: predict with that file; 'none': no prediction",
    )
    p.add_argument("--calibration-out", default=str(ROOT / "configs" / "calibration-gemma3-270m-cpu.toml"))
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="replays per setup, in alternating order (A B C, then C B A, ...), their samples pooled: "
        "evens out load from other processes on a shared machine",
    )
    p.add_argument(
        "--from-requests",
        default=None,
        help="run nothing: re-render the figures, report and plot from a saved .requests.json "
        "(with a prediction from --calibration)",
    )
    p.add_argument(
        "--keep-dir",
        default=None,
        help="keep every setup's home (logs, fact stores with the routing decisions) under this directory",
    )
    p.add_argument("--timeout-s", type=float, default=300.0, help="per request")
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument("--md", default=None, help="Markdown report (default: the JSON path with .md)")
    p.add_argument("--png", default=None, help="TTFT CDF plot (default: the JSON path with .png)")
    p.add_argument(
        "--requests-json", default=None, help="per-request measurements (default: the JSON path with .requests.json)"
    )
    return p.parse_args(argv)


def load_prompts(args: argparse.Namespace) -> tuple[str, list[TracePrompt]]:
    """The served model's name and the slice's prompts."""
    import torch

    from kvrelay.models.loading.loader import load_artifacts
    from kvrelay.sim.trace import TraceError

    artifacts = load_artifacts(args.model, dtype=torch.bfloat16 if args.dtype == "bfloat16" else torch.float32)
    scaling = Scaling(args.block_tokens, 512, args.max_prompt_tokens, args.max_output_tokens, args.time_stretch)
    try:
        return artifacts.name, slice_prompts(args.trace, args.offset, args.count, artifacts.tokenizer, scaling)
    except TraceError as exc:
        raise SystemExit(str(exc)) from None


async def run_setup(
    name: str,
    options: FaceOptions,
    home: Path,
    model: str,
    prompts: list[TracePrompt],
    sglang: str | None,
    timeout_s: float,
) -> tuple[list[Measured], dict]:
    """Start the setup, warm it up, replay the prompts, stop it; the measurements and the routers' decisions."""
    if name == "sglang_cache_aware":
        face, urls = serve_workers(name, options, home)
    else:
        face, urls = kvrelay_cluster(name, "kvrelay" if name == "kvrelay" else "round_robin", options, home), []
    try:
        if not urls:
            await until(lambda: face.log_has("cluster", CLUSTER_READY), face, 300.0)
        for url in urls or [face.url]:
            await wait_ready(url, model, face)
        if urls:
            assert sglang is not None
            start_peer(face, Peer.SGLANG_ROUTER, sglang, "cache_aware", urls)
            await wait_ready(face.url, model, face)
        await warm_up(face.url, model)
        started = time.perf_counter()
        run0, wait0 = face.sched_seconds()
        measured = await replay(face.url, model, prompts, timeout_s)
        run1, wait1 = face.sched_seconds()
        availability = (run1 - run0) / max(1e-9, run1 - run0 + wait1 - wait0)
        print(
            f"  {name}: replayed {len(prompts)} requests in {time.perf_counter() - started:.1f} s; CPU s by "
            f"process: { {k: round(v, 1) for k, v in face.cpu_seconds().items()} }; workers' CPU availability "
            f"{availability:.2f}",
            flush=True,
        )
    except BaseException:
        print(f"  {name} failed; logs: {face.logs()}", flush=True)
        raise
    finally:
        face.stop()
    stores = (
        {f"serve{i}": home / f"serve{i}" / "data" / "facts.sqlite3" for i in range(len(urls))}
        if urls
        else {"router": home / "data" / "facts.sqlite3"}
    )
    routing = {**routing_summary(stores), "worker_cpu_availability": availability}
    print(f"  {name} decisions: {routing}", flush=True)
    return measured, routing


def run_all(
    args: argparse.Namespace,
    setups: list[str],
    options: FaceOptions,
    model: str,
    prompts: list[TracePrompt],
    sglang: str | None,
) -> tuple[dict[str, list[list[Measured]]], dict]:
    """Every setup ``args.rounds`` times in alternating order: measurements and routing summaries per replay."""
    work = Path(args.keep_dir) if args.keep_dir else Path(tempfile.mkdtemp(prefix="kvrelay-trace-e2e-"))
    results: dict[str, list[list[Measured]]] = {name: [] for name in setups}
    routing: dict[str, list[dict]] = {name: [] for name in setups}
    try:
        for round_ in range(args.rounds):
            for name in setups if round_ % 2 == 0 else setups[::-1]:
                print(f"setup {name} (round {round_ + 1}) ...", flush=True)
                measured, decided = asyncio.run(
                    run_setup(name, options, work / f"{name}-{round_}", model, prompts, sglang, args.timeout_s)
                )
                results[name].append(measured)
                routing[name].append(decided)
    finally:
        if not args.keep_dir:
            shutil.rmtree(work, ignore_errors=True)
    return results, routing


def calibrate(args: argparse.Namespace) -> None:
    """``bench/calibrate.py`` in a child process with the workers' threads, lanes, KV size, model and dtype."""
    import subprocess

    argv = [
        sys.executable,
        str(ROOT / "bench" / "calibrate.py"),
        "--dtype",
        args.dtype,
        "--threads",
        str(args.threads),
        "--lanes",
        str(args.lanes),
        "--kv-tokens",
        str(args.kv_tokens),
        "--out",
        args.calibration_out,
        *(["--model", args.model] if args.model else []),
    ]
    subprocess.run(argv, check=True)


def predict(args: argparse.Namespace, prompts: list[TracePrompt], availabilities: list[float]):
    """The simulator's TTFTs for ``prompts``, once per kvrelay replay with the calibration's costs scaled from its
    CPU availability to that replay's, samples pooled; also the scale factors."""
    from kvrelay.bench.trace.simulate import pooled, predict_ttft
    from kvrelay.sim.calibration import (
        apply_calibration,
        load_calibration,
        scale_costs,
    )
    from kvrelay.sim.cluster_config import load_cluster_config
    from kvrelay.sim.replay import with_workers

    calibration = load_calibration(args.calibration)
    factors = [float(calibration.measured.get("cpu_availability", 1.0)) / a for a in availabilities]
    runs = [
        predict_ttft(
            prompts, with_workers(apply_calibration(load_cluster_config(), scale_costs(calibration, f)), 2), "kvrelay"
        )
        for f in factors
    ]
    return pooled(runs), factors


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setups = [s for s in args.setups.split(",") if s]
    unknown = [s for s in setups if s not in SETUPS]
    if unknown or "kvrelay" not in setups:
        raise SystemExit(f"--setups: unknown {unknown} or kvrelay missing; choose from {', '.join(SETUPS)}")
    sglang = find_peer(Peer.SGLANG_ROUTER, args.routers_venvs)
    notes: list[str] = []
    if "sglang_cache_aware" in setups and sglang is None:
        setups.remove("sglang_cache_aware")
        notes.append("sglang-router is not installed: the sglang_cache_aware setup is left out.")
        print(notes[-1], flush=True)
    model, prompts = load_prompts(args)
    tokens = sum(len(p.token_ids) for p in prompts)
    span = max(p.arrival_s for p in prompts)
    print(
        f"slice: trace lines {prompts[0].line}..{prompts[-1].line}, {len(prompts)} requests, {tokens} prompt "
        f"tokens, {span:.1f} s of arrivals; model {model}",
        flush=True,
    )
    options = FaceOptions(args.model, args.dtype, args.kv_tokens, args.lanes, args.threads)
    if args.calibration == "measure":
        print("calibrating ...", flush=True)
        calibrate(args)
        args.calibration = args.calibration_out
    if args.from_requests:
        saved = json.loads(Path(args.from_requests).read_text())
        results = {n: [[Measured(**m) for m in run] for run in runs] for n, runs in saved["requests"].items()}
        routing: dict[str, list[dict]] = saved["routing"]
    else:
        results, routing = run_all(args, setups, options, model, prompts, sglang)
    if args.json and not args.from_requests:  # saved first, so a later failure cannot lose the replays
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.requests_json or Path(args.json).with_suffix(".requests.json")).write_text(
            json.dumps(
                {
                    "requests": {n: [[asdict(m) for m in run] for run in runs] for n, runs in results.items()},
                    "routing": routing,
                }
            )
            + "\n"
        )
    summaries = {name: summarize(m) for name, m in results.items()}
    per_replay = [
        (name, i + 1, routing[name][i]["worker_cpu_availability"], summarize([run]))
        for name, runs in results.items()
        for i, run in enumerate(runs)
    ]
    figures = comparison_figures("kvrelay", summaries)
    prediction = None
    if args.calibration != "none":
        availabilities = [r["worker_cpu_availability"] for r in routing["kvrelay"]]
        prediction, factors = predict(args, prompts, availabilities)
        figures += calibration_figures(summaries["kvrelay"], prediction.as_dict())
    notes += [
        (
            f"Slice: {args.trace.name} requests {args.offset}..{args.offset + len(prompts) - 1} (timestamp order), "
            f"{len(prompts)} requests, {tokens} prompt tokens, arrivals over {span:.1f} s; {args.rounds} replay(s) "
            "per setup, in alternating order, samples pooled."
        ),
        (
            f"Scaling: one 512-token trace block = {args.block_tokens} tokens; prompts capped at "
            f"{args.max_prompt_tokens} tokens, outputs at {args.max_output_tokens}; arrival times "
            f"x{args.time_stretch:g}."
        ),
        (
            f"Machine: {platform.machine()}, {os.cpu_count()} CPUs; model {model} ({args.dtype}), "
            f"{args.threads} torch thread(s) per process, {args.lanes} lanes and {args.kv_tokens} KV tokens per "
            "worker."
        ),
        (
            "TTFT: client-side, request sent to the first streamed text chunk. Cached tokens: usage "
            "prompt_tokens_details.cached_tokens."
        ),
    ]
    if prediction is not None:
        shown = str(args.calibration).replace(str(ROOT) + os.sep, "")
        notes.append(
            f"Simulator: `kvrelay sim` machinery with {shown}, same prompts and arrivals, "
            f"2 workers, kvrelay policy, one simulation per kvrelay replay, samples pooled "
            f"({prediction.completed} first tokens); compute costs scaled "
            f"x{', x'.join(f'{f:.2f}' for f in factors)} = CPU availability while calibrating / the "
            "kvrelay workers' CPU availability in that replay (/proc schedstat: run / (run + run-queue "
            "wait))."
        )
    notes.append(
        "Workers' CPU availability per replay (other processes on the shared machine take the rest): "
        + "; ".join(
            f"{n}: " + ", ".join(f"{r['worker_cpu_availability']:.2f}" for r in rs) for n, rs in routing.items()
        )
    )
    title = "Trace replay end to end: kvrelay router against sglang-router and round robin"
    text = markdown(title, summaries, LABELS, notes, prediction.as_dict() if prediction else None, per_replay)
    print(text)
    for f in figures:
        base = "" if f["baseline"] is None else f"  ({f['baseline']}: {f['baseline_value']:.4g})"
        print(f"{f['name']:<44} {f['value']:>10.4g} {f['unit']:<7}{base}")
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(figures, indent=1) + "\n")
        Path(args.md or out.with_suffix(".md")).write_text(text)
        samples = {
            n: [m.ttft_s for run in runs for m in run if m.ttft_s is not None and m.error is None]
            for n, runs in results.items()
        }
        labels = dict(LABELS)
        if prediction is not None:
            samples["simulator"] = list(prediction.samples)
            labels["simulator"] = "simulator (kvrelay policy, calibrated)"
        plot_cdf(args.png or out.with_suffix(".png"), samples, labels, f"TTFT CDF, {len(prompts)} trace requests")
        print(f"wrote {out} and its .md, .png, .requests.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
