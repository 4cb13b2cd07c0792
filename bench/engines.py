"""kvrelay's runtime against vLLM: the same model, machine and streaming client, alternating rounds in one run.

Both servers run at once for the whole run (``kvrelay.bench.engines.servers``: ``kvrelay serve --lanes N`` and
vLLM's OpenAI server, its CPU build from ``.venv-vllm``, both in bfloat16 with ``--threads`` torch threads
each; only one of them has work at any moment). The model is Gemma 3 270M by default: kvrelay's converted
directory under the model cache (``kvrelay.models.loading.loader.model_directory``), which vLLM serves too,
under the same name. Each round measures, on both servers one after the other (kvrelay first in even rounds,
vLLM first in odd ones), with fresh prompts both servers share (``kvrelay.bench.engines.measure``), each
measurement starting once both servers are quiet (``servers.wait_quiet``: vLLM keeps a core busy for about
1 s after each request). Both are read by the same streaming client (``--client``: by default the light
one of ``kvrelay.bench.streams``, which takes about a fifth of the official ``openai`` client's CPU a
token from the cores the servers run on; ``openai`` for the official one):

1. ``decode_c{N}_tokens_per_s`` for each ``--streams`` N: N completions of ``--decode-prompt`` random tokens
   and ``--decode-tokens`` new tokens each, sent at once; the aggregate rate while every stream decodes.
2. ``cold_ttft_s`` and ``prefill_tokens_per_s``: a fresh ``--cold-prompt``-token prompt alone (TTFT and
   prompt tokens over it).
3. ``warm_ttft_s``: that prompt's first ``cold - --warm-suffix`` tokens again with a new suffix; with each
   server's reported cached prompt tokens (``warm_cached_share``) and vLLM's prefix-cache hit share from its
   ``/metrics`` (``vllm_prefix_cache_hit_share``).
   A round measures ``--ttft-prompts`` such pairs on each server, the servers taking turns (the one that went
   second goes first for the next prompt), and its figures are their medians: one cold prompt a round moved with
   the machine's minute (this VM ran ``kvrelay serve``'s cold prompt in 0.8 to 1.4 s within an hour).

Then ``peak_rss_mib`` of each server's process tree, and each decode's share of the compute limit
(``kvrelay.bench.engines.compute``: the machine's measured bfloat16 GEMM peak over the model's FLOPs per
token at the decode's mean context). One stream is bound by memory instead: ``decode_c1_bandwidth_floor_tokens_per_s``
is the machine's measured read rate over the bytes one step reads (kvrelay: bfloat16 projections and its int8
greedy screen of the head; baseline: the full bfloat16 head), and ``decode_c1_share_of_bandwidth_floor`` each
server's one-stream rate over its own floor. Where twice vLLM's one-stream rate is above kvrelay's floor, the
2x goal needs an exact runtime to read faster than the machine can. The cold prompt is bound by compute:
``cold_ttft_compute_floor_s`` is its prefill's FLOPs (``compute.prefill_flops``) over the measured peak, and
``cold_ttft_share_of_compute_floor`` each server's cold TTFT against it (the floor over the TTFT). Every
figure is the median over rounds; ``*_ratio`` is kvrelay's advantage (a rate over vLLM's, vLLM's time over
kvrelay's) with its least and largest round. The goal: 2x on every decode, 1.5x on cold TTFT. Prints a table,
writes ``--json`` and a PNG next to it.

Run (figures for the README, the machine shared, so under the bench lock):
``flock /tmp/kvrelay-bench.lock .venv/bin/python bench/engines.py --json bench/results/engines.json``
(about 15 minutes after vLLM's 2 to 10 minute start).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from statistics import median

import httpx

from kvrelay.bench.engines.compute import bytes_per_token, flops_per_token, peak_flops, prefill_flops, read_rate
from kvrelay.bench.engines.measure import decode, prompts, ttft
from kvrelay.bench.engines.report import Comparison, Samples, figures, plot, print_comparisons
from kvrelay.bench.engines.servers import EngineServer, ServerSpec, start_kvrelay, start_vllm, wait_quiet
from kvrelay.bench.report import Figure, report
from kvrelay.bench.streams import StreamClient
from kvrelay.engines.vllm.identity import DTYPE_BYTES
from kvrelay.launch.vllm_server import UNIPROCESS_ARGS, UNIPROCESS_ENV, VllmNotInstalled, vllm_python
from kvrelay.models.config import ModelConfig
from kvrelay.models.loading.default_model import DEFAULT_MODEL_NAME
from kvrelay.models.loading.loader import model_directory

ENGINES = ("kvrelay", "vllm")
SCREENED_HEAD_BYTES = 1
"""Bytes per head weight one kvrelay step reads (its int8 greedy screen; plus 36 per row: the row's terms and its
bound), against 2 for a runtime that computes the full bfloat16 logits."""
DECODE_GOAL = 2.0
COLD_TTFT_GOAL = 1.5


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory or GGUF (default: Gemma 3 270M)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    parser.add_argument("--streams", default="1,8,32", help="concurrent streams of the decode figures (default 1,8,32)")
    parser.add_argument("--decode-prompt", type=int, default=256, help="prompt tokens per decode stream (default 256)")
    parser.add_argument("--decode-tokens", type=int, default=64, help="new tokens per decode stream (default 64)")
    parser.add_argument("--cold-prompt", type=int, default=4096, help="prompt tokens of the TTFT figures")
    parser.add_argument("--warm-suffix", type=int, default=512, help="new tokens after the warm prefix (default 512)")
    parser.add_argument(
        "--ttft-prompts",
        type=int,
        default=3,
        help="cold prompts (each with its warm one) per round and server, the servers taking turns; a round's "
        "figure is their median (default 3)",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each server (default 2)")
    parser.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="both servers' dtype (default bfloat16; float32 for a smoke run where vLLM's bfloat16 path cannot run)",
    )
    parser.add_argument("--lanes", type=int, default=None, help="kvrelay lanes, vLLM max-num-seqs (default: streams)")
    parser.add_argument("--kv-tokens", type=int, default=65536, help="KV tokens of each server (default 65536)")
    parser.add_argument("--vllm-python", default=None, help="Python of vLLM's venv (default: as kvrelay finds it)")
    parser.add_argument("--vllm-batched-tokens", type=int, default=None, help="vLLM --max-num-batched-tokens")
    parser.add_argument("--vllm-force-omp-threads", action="store_true", help="also set OMP_NUM_THREADS for vLLM")
    parser.add_argument("--vllm-eager", action="store_true", help="vLLM without torch.compile (fast start; smoke)")
    parser.add_argument(
        "--vllm-uniprocess",
        action="store_true",
        help="vLLM's model in its engine core's process, not its CPU default's model-runner process "
        "(kvrelay.launch.vllm_server.VllmServerSpec.uniprocess)",
    )
    parser.add_argument(
        "--vllm-env", action="append", default=[], metavar="KEY=VALUE", help="more environment for vLLM (repeatable)"
    )
    parser.add_argument(
        "--omp-spincount",
        type=int,
        default=None,
        help="GOMP_SPINCOUNT of both servers (default unset: passive OpenMP threads sleep at once); for a machine "
        "dedicated to the server, e.g. 20000",
    )
    parser.add_argument(
        "--client",
        type=StreamClient,
        choices=list(StreamClient),
        default=StreamClient.LIGHT,
        help="the streaming client of both servers: light (aiohttp and msgspec, the default: it takes a fifth of "
        "the official client's CPU from the cores the servers run on) or openai (the official client)",
    )
    parser.add_argument("--ready-timeout", type=float, default=1200.0, help="seconds a server may take to start")
    parser.add_argument("--work-dir", type=Path, default=None, help="logs and kvrelay's data (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here (and the PNG next to it)")
    args = parser.parse_args(argv)
    try:
        python = Path(vllm_python(args.vllm_python))
    except VllmNotInstalled as exc:
        parser.error(str(exc))
    streams = sorted({int(n) for n in args.streams.split(",")})
    if args.warm_suffix >= args.cold_prompt:
        parser.error("--warm-suffix must be shorter than --cold-prompt")
    if args.ttft_prompts < 1:
        parser.error("--ttft-prompts must be at least 1")

    model_dir = model_directory(args.model)
    config = ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    name = DEFAULT_MODEL_NAME if args.model is None else Path(args.model).stem
    peak, peak_way = peak_flops(args.threads)
    read = read_rate(args.threads)
    print(
        f"model {name} ({model_dir}); bf16 GEMM peak {peak / 1e9:.1f} GFLOP/s (as {peak_way}); "
        f"memory read {read / 1e9:.1f} GB/s; the {args.client.value} client",
        flush=True,
    )
    load_before = os.getloadavg()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench-engines-"))
    eager = ("--enforce-eager",) if args.vllm_eager else ()
    uniprocess = (UNIPROCESS_ARGS, UNIPROCESS_ENV) if args.vllm_uniprocess else ((), ())
    spec = ServerSpec(
        model_dir=model_dir,
        model_name=name,
        kvrelay_model=args.model,
        threads=args.threads,
        lanes=args.lanes or max(streams),
        kv_tokens=args.kv_tokens,
        kv_bytes_per_token=config.num_layers * 2 * config.num_kv_heads * config.head_dim * DTYPE_BYTES[args.dtype],
        max_model_len=min(config.max_position_embeddings, args.cold_prompt + args.decode_tokens + 64),
        work_dir=work,
        vllm_python=python,
        vllm_batched_tokens=args.vllm_batched_tokens,
        vllm_force_omp_threads=args.vllm_force_omp_threads,
        vllm_extra=eager + uniprocess[0],
        vllm_env=uniprocess[1] + env_pairs(parser, args.vllm_env),
        omp_spincount=args.omp_spincount,
        dtype=args.dtype,
    )
    servers: dict[str, EngineServer] = {}
    try:
        servers["kvrelay"] = start_kvrelay(spec)
        servers["vllm"] = start_vllm(spec)
        for server in servers.values():
            started = time.monotonic()
            server.wait_ready(args.ready_timeout)
            print(f"{server.name} ready at {server.url} ({time.monotonic() - started:.0f} s more)", flush=True)
        samples, hit_shares = run_rounds(servers, config.vocab_size, streams, args)
        rss = {engine: servers[engine].peak_rss_mib() for engine in ENGINES}
        version = servers["vllm"].version
    finally:
        for server in servers.values():
            server.stop()
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    load_after = os.getloadavg()

    peer = f"vllm {version}"
    decodes = [(n, compare(samples, f"decode_c{n}_tokens_per_s", "tokens/s", True, DECODE_GOAL)) for n in streams]
    cold = compare(samples, "cold_ttft_s", "s", False, COLD_TTFT_GOAL)
    warm = compare(samples, "warm_ttft_s", "s", False)
    comparisons = [c for _, c in decodes] + [
        cold,
        compare(samples, "prefill_tokens_per_s", "tokens/s", True),
        warm,
        compare(samples, "warm_cached_share", "ratio", True),
    ]
    context = args.decode_prompt + args.decode_tokens / 2
    limit = peak / flops_per_token(config, context)
    for n, c in decodes:
        comparisons.append(share_of(c, lambda engine, value: value / limit, f"decode_c{n}_share_of_compute_limit"))
    floors = {
        "kvrelay": read / bytes_per_token(config, context, SCREENED_HEAD_BYTES * config.hidden_size + 36),
        "vllm": read / bytes_per_token(config, context, 2 * config.hidden_size),
    }
    one_stream = dict(decodes).get(1)
    if one_stream is not None:
        by_floor = share_of(
            one_stream, lambda engine, value: value / floors[engine], "decode_c1_share_of_bandwidth_floor"
        )
        comparisons.append(by_floor)
    floor_s = prefill_flops(config, args.cold_prompt) / peak
    comparisons.append(share_of(cold, lambda engine, value: floor_s / value, "cold_ttft_share_of_compute_floor"))
    print_comparisons(comparisons, peer)
    out = figures(comparisons, peer)
    out += [
        Figure("peak_rss_mib", rss["kvrelay"], "MiB", peer, rss["vllm"]),
        Figure("vllm_prefix_cache_hit_share", sum(hit_shares) / len(hit_shares), "ratio"),
        Figure("bf16_peak_gflops", peak / 1e9, "GFLOP/s"),
        Figure("compute_limit_tokens_per_s", limit, "tokens/s"),
        Figure("memory_read_gbs", read / 1e9, "GB/s"),
        Figure(
            "decode_c1_bandwidth_floor_tokens_per_s", floors["kvrelay"], "tokens/s", "full bf16 head", floors["vllm"]
        ),
        Figure("cold_ttft_compute_floor_s", floor_s, "s"),
        Figure("load_average_before", load_before[0], "runnable"),
        Figure("load_average_after", load_after[0], "runnable"),
    ]
    print(
        f"bf16 peak: torch {peak_way} GEMM on {args.threads} threads; compute limit at a mean decode context of "
        f"{context:g} tokens; the cold prompt's compute floor {floor_s:.3f} s (the {COLD_TTFT_GOAL:g}x goal "
        f"asks for {median(cold.theirs) / COLD_TTFT_GOAL:.3f} s); load average (1, 5, 15 min) before "
        f"{load_before}, after {load_after}"
    )
    spin = "" if args.omp_spincount is None else f", GOMP_SPINCOUNT {args.omp_spincount}"
    title = f"kvrelay serve vs {peer}: {name}, {args.dtype}, {args.threads} threads, {args.rounds} rounds{spin}"
    report(title, out, str(args.json) if args.json else None)
    if args.json:
        title = (
            f"kvrelay vs {peer}, {name} bf16, {args.threads} threads, {args.rounds} rounds "
            f"(medians; whiskers: least and largest round)"
        )
        plot(args.json.with_suffix(".png"), decodes, [("cold", cold), ("warm prefix", warm)], peer, title)
    return 0


def env_pairs(parser: argparse.ArgumentParser, items: list[str]) -> tuple[tuple[str, str], ...]:
    """``KEY=VALUE`` items as pairs; a parser error names a malformed one."""
    pairs = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            parser.error(f"--vllm-env {item!r} is not KEY=VALUE")
        pairs.append((key, value))
    return tuple(pairs)


def run_rounds(
    servers: dict[str, EngineServer], vocab: int, streams: list[int], args: argparse.Namespace
) -> tuple[Samples, list[float]]:
    """Every figure on both servers, round after round, alternating which goes first (see the docstring)."""
    samples = Samples()
    hit_shares: list[float] = []
    warm_up(servers, vocab, streams, args)
    for round_ in range(args.rounds):
        order = ENGINES if round_ % 2 == 0 else ENGINES[::-1]
        for n in streams:
            batch = prompts(n, args.decode_prompt, vocab, seed=1000 * round_ + n)
            for engine in order:
                server = servers[engine]
                wait_quiet(list(servers.values()))
                result = decode(server.url, server.model_name, batch, args.decode_tokens, args.client)
                samples.add(engine, f"decode_c{n}_tokens_per_s", result.tokens_per_s)
                print(
                    f"round {round_} {engine:8} {n:3} streams: {result.tokens_per_s:8.1f} tokens/s "
                    f"({result.window_s:.1f} s window, {result.completion_tokens} tokens)",
                    flush=True,
                )
        colds: dict[str, list[float]] = {engine: [] for engine in order}
        warms: dict[str, list[float]] = {engine: [] for engine in order}
        cached: dict[str, list[float]] = {engine: [] for engine in order}
        for i in range(args.ttft_prompts):
            (cold_prompt,) = prompts(1, args.cold_prompt, vocab, seed=1000 * round_ + 999 - 2 * i)
            (suffix,) = prompts(1, args.warm_suffix, vocab, seed=1000 * round_ + 998 - 2 * i)
            warm_prompt = cold_prompt[: args.cold_prompt - args.warm_suffix] + suffix
            for engine in order if i % 2 == 0 else order[::-1]:
                server = servers[engine]
                wait_quiet(list(servers.values()))
                cold = ttft(server.url, server.model_name, cold_prompt, args.client)
                before = prefix_cache_counts(server) if engine == "vllm" else None
                wait_quiet(list(servers.values()))
                warm = ttft(server.url, server.model_name, warm_prompt, args.client)
                if before is not None:
                    queries, hits = (b - a for a, b in zip(before, prefix_cache_counts(server)))
                    hit_shares.append(hits / queries if queries else 0.0)
                colds[engine].append(cold.seconds)
                warms[engine].append(warm.seconds)
                cached[engine].append(warm.cached_tokens / warm.prompt_tokens)
                print(
                    f"round {round_} {engine:8} TTFT cold {cold.seconds:.3f} s, warm {warm.seconds:.3f} s "
                    f"({warm.cached_tokens} of {warm.prompt_tokens} prompt tokens cached)",
                    flush=True,
                )
        for engine in order:
            samples.add(engine, "cold_ttft_s", median(colds[engine]))
            samples.add(engine, "prefill_tokens_per_s", args.cold_prompt / median(colds[engine]))
            samples.add(engine, "warm_ttft_s", median(warms[engine]))
            samples.add(engine, "warm_cached_share", median(cached[engine]))
    return samples, hit_shares


def warm_up(servers: dict[str, EngineServer], vocab: int, streams: list[int], args: argparse.Namespace) -> None:
    """A short run of every concurrency and a cold prompt on each server: first-use costs (vLLM's compiled
    shapes, kvrelay's first forward) stay out of the figures."""
    for engine in ENGINES:
        server = servers[engine]
        for n in streams:
            decode(server.url, server.model_name, prompts(n, 64, vocab, seed=-n), 8, args.client)
        ttft(server.url, server.model_name, prompts(1, args.cold_prompt, vocab, seed=-1)[0], args.client)


def prefix_cache_counts(server: EngineServer) -> tuple[float, float]:
    """vLLM's prefix-cache queries and hits so far (tokens), summed over its ``/metrics`` series."""
    text = httpx.get(server.url + "/metrics", timeout=10.0).text
    totals = []
    for metric in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
        pattern = rf"^{re.escape(metric)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$"
        totals.append(sum(float(v) for v in re.findall(pattern, text, re.MULTILINE)))
    return totals[0], totals[1]


def compare(
    samples: Samples, figure: str, unit: str, higher: bool, goal: float | None = None, name: str | None = None
) -> Comparison:
    return Comparison(
        name or figure, unit, tuple(samples.of("kvrelay", figure)), tuple(samples.of("vllm", figure)), higher, goal
    )


def share_of(c: Comparison, share: Callable[[str, float], float], name: str) -> Comparison:
    """Each round's ``share(engine, value)`` of ``c`` on both servers, compared as a ratio named ``name``."""
    shares = Samples()
    for engine, values in (("kvrelay", c.ours), ("vllm", c.theirs)):
        for value in values:
            shares.add(engine, "share", share(engine, value))
    return compare(shares, "share", "ratio", True, name=name)


if __name__ == "__main__":
    sys.exit(main())
