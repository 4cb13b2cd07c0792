"""Failover the client cannot see, on Gemma 3 270M: exact continuations against today's prefill recompute.

A router, a moto_server object tier and two workers serve the model in bfloat16
(``kvrelay.bench.cluster``): ``wx`` continues streams exactly (the default:
delivered tokens replayed as decode steps, ``Job.replay``) and ``wp`` with
``--exact-continuations false`` (the delivered tokens recomputed in one prefill).
``--streams`` streams of ``--tokens`` tokens (distinct prompts of 12 to 40 token
ids; 256-token chunks, so no chunk of a stream is registered or restored) run once
undisturbed per sampling (greedy, and seeded at temperature 0.9); then, per round
and per mode, again while the *other* worker is killed (``kill -9``) once it holds
at least two of them mid-way, so every cut stream continues on the worker of the
mode measured. The killed worker is restarted after each run. Which mode goes first
flips from one (round, sampling) to the next.

Figures, per mode: streams whose text equals the undisturbed one (of all streams
run, and of the cut ones), the continuation's time to first token as the client
sees it (from the kill to the cut stream's next token: median and p90 over cut
streams), and the run's throughput (tokens over its wall time); the exact mode's
baselines are the prefill mode's. The ratio of the median resume times per round
is printed with its spread.

Run: ``flock /tmp/kvrelay-bench.lock .venv/bin/python bench/exact_failover.py --json
bench/results/exact_failover.json``
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvrelay.bench.cluster import BenchCluster, ClusterSpec
from kvrelay.bench.failover import Cut, Stream, StreamSpec, compare, run_round
from kvrelay.bench.report import Figure, report

MODES = {"exact": ("wx", "wp"), "prefill": ("wp", "wx")}
"""Mode -> (the worker that continues, the worker killed)."""
SAMPLINGS = {"greedy": 0.0, "seeded": 0.9}
CHUNK_TOKENS = 256
"""Longer than a stream, so no chunk of one is registered: a continuation finds nothing to restore from the
undisturbed runs and computes every delivered token's K/V."""
ATTEMPTS = 4
"""Runs of a round until the worker to kill holds two streams mid-way."""


@dataclass
class Tally:
    streams: int = 0
    same: int = 0
    cut: int = 0
    cut_same: int = 0
    resumed_s: list[float] = field(default_factory=list)
    round_medians: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)


def specs_of(streams: int, tokens: int, temperature: float, ids: tuple[int, int]) -> list[StreamSpec]:
    gen = torch.Generator().manual_seed(17)
    prompts = [
        tuple(torch.randint(ids[0], ids[1], (12 + (28 * i) // max(1, streams - 1),), generator=gen).tolist())
        for i in range(streams)
    ]
    return [StreamSpec(p, tokens, temperature, None if temperature == 0 else 90 + i) for i, p in enumerate(prompts)]


def measure(cluster: BenchCluster, mode: str, specs: list[StreamSpec], reference: list[Stream], tally: Tally) -> None:
    _, victim = MODES[mode]
    cut = Cut(
        lambda: cluster.cluster()["requests"],
        cluster.kill_worker,
        min_delivered=8,
        min_left=24,
        victims=frozenset({victim}),
    )
    for _ in range(ATTEMPTS):
        started = time.monotonic()
        streams, strike = run_round(cluster.http_url, cluster.model_name(), specs, cut)
        wall = time.monotonic() - started
        if strike is not None:
            break
    else:
        raise RuntimeError(f"{mode}: {victim} never held two streams mid-way in {ATTEMPTS} runs")
    outcome = compare(reference, streams, strike)
    if not all(outcome.complete):  # a diverged seeded stream may sample the EOS token: it differs, it is not lost
        print(f"  {mode}: streams ending short of the budget: {[s.finish_reason for s in streams]}", flush=True)
    tally.streams += len(specs)
    tally.same += sum(outcome.same)
    tally.cut += len(outcome.cut_waits)
    tally.cut_same += outcome.cut_same
    tally.resumed_s += outcome.cut_waits
    if outcome.cut_waits:
        tally.round_medians.append(statistics.median(outcome.cut_waits))
    tally.tokens_per_s.append(sum(s.completion_tokens or 0 for s in streams) / wall)
    print(
        f"  {mode:<8} cut {strike.held} on {strike.victim}: same {sum(outcome.same)}/{len(specs)}, "
        f"resumed after {', '.join(f'{w:.2f}' for w in outcome.cut_waits)} s",
        flush=True,
    )
    cluster.start_worker(victim)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model directory or .gguf (default: Gemma 3 270M)")
    p.add_argument("--streams", type=int, default=6)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--ids", type=int, nargs=2, default=(1000, 30000), help="prompt token ids are drawn from [LO, HI)")
    p.add_argument("--work-dir", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="kvrelay-exact-failover-"))
    flags = ("--chunk-tokens", str(CHUNK_TOKENS))
    spec = ClusterSpec(
        work, args.model, lanes=8, worker_flags={"wx": flags, "wp": (*flags, "--exact-continuations", "false")}
    )
    cluster = BenchCluster(spec)
    tallies = {mode: Tally() for mode in MODES}
    try:
        cluster.start(["wx", "wp"])
        references = {}
        for name, temperature in SAMPLINGS.items():
            specs = specs_of(args.streams, args.tokens, temperature, (args.ids[0], args.ids[1]))
            reference = run_round(cluster.http_url, cluster.model_name(), specs)[0]
            if any(s.completion_tokens != args.tokens or s.error for s in reference):
                raise RuntimeError(f"an undisturbed {name} stream did not complete: {[s.error for s in reference]}")
            references[name] = (specs, reference)
        for r in range(args.rounds):
            for k, (name, (specs, reference)) in enumerate(references.items()):
                order = list(MODES) if (r + k) % 2 == 0 else list(MODES)[::-1]
                print(f"round {r + 1}, {name}", flush=True)
                for mode in order:
                    measure(cluster, mode, specs, reference, tallies[mode])
    finally:
        cluster.close()
    x, pf = tallies["exact"], tallies["prefill"]
    ratios = [a / b for a, b in zip(x.round_medians, pf.round_medians, strict=False) if b > 0]
    if ratios:
        print(
            f"resume time exact / prefill, per round and sampling: median {statistics.median(ratios):.2f} "
            f"(min {min(ratios):.2f}, max {max(ratios):.2f}, n {len(ratios)})"
        )

    def p90(values: list[float]) -> float:
        return sorted(values)[int(0.9 * (len(values) - 1))] if values else float("nan")

    figures = [
        Figure("streams_identical", x.same, "streams", "prefill", pf.same),
        Figure("streams_run", x.streams, "streams", "prefill", pf.streams),
        Figure("cut_streams_identical", x.cut_same, "streams", "prefill", pf.cut_same),
        Figure("cut_streams", x.cut, "streams", "prefill", pf.cut),
        Figure("resume_p50_s", statistics.median(x.resumed_s), "s", "prefill", statistics.median(pf.resumed_s)),
        Figure("resume_p90_s", p90(x.resumed_s), "s", "prefill", p90(pf.resumed_s)),
        Figure("resume_ratio_p50", statistics.median(ratios) if ratios else float("nan"), "x"),
        Figure(
            "tokens_per_s", statistics.median(x.tokens_per_s), "tok/s", "prefill", statistics.median(pf.tokens_per_s)
        ),
    ]
    report(f"exact failover ({args.streams} streams of {args.tokens} tokens, kill -9 mid-stream)", figures, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
