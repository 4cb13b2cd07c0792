"""Overload at the router: goodput and rejections under 3x overload, with and without the router queue.

Goodput is the number of requests whose first token came within the TTFT bound;
every other request either came late, was refused (``queue_full``: a 429 with
``Retry-After`` at the API), or is lost (no answer, or more than one: must be 0).

Simulator (``--sim``): the development trace on the default cluster under
kvrelay's policy at ``--rate-scale`` 6 (the cluster saturates near 2x, where its
workers are busy 97 % of the time, so 6x offers about three times what it
serves), replayed without the router queue (``QUEUE_OFF``), with the queue at
its defaults, and with the queue's bounds set from the TTFT bound (start
within a quarter of it, refuse when the predicted wait passes half of it).

Live (``--live``): real processes on this machine: per system one ``kvrelay
router`` and ``--workers`` ``kvrelay worker`` processes serving a small random
Llama (float32, one thread each); the official ``openai`` client streams
completions of distinct random prompts. The cluster's capacity (completions per
second) is measured closed-loop first; each round then sends Poisson arrivals at
``--overload`` times that rate for ``--round-s`` seconds and waits for every
answer. Rounds alternate between the system without the router queue
(``--queue-start-within-s inf --queue-max-wait-s inf``) and the one with it
(bounds from the live TTFT bound, as in the simulator). Both clusters run all
along; only one is sent traffic at a time.

Run: ``flock /tmp/kvrelay-bench.lock .venv/bin/python bench/overload.py --json bench/results/overload.json``
"""

from __future__ import annotations

import argparse
import math
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from kvrelay.bench.report import Figure, report
from kvrelay.core.router.queue import QUEUE_OFF, Limits
from kvrelay.core.router.state import RouterConfig

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "data" / "traces" / "mooncake_synthetic_trace.jsonl"


def tuned(bound_s: float) -> Limits:
    """The router queue's bounds for a TTFT bound: wait at the router past a quarter of it, refuse past half."""
    return Limits(start_within_s=bound_s / 4, max_wait_s=bound_s / 2)


def summary(
    ttfts: list[float],
    refused: int,
    refused_with_retry: int,
    other_errors: int,
    lost: int,
    bound_s: float,
    offered: int,
) -> dict[str, Any]:
    """The figures of one system's run (see the module docstring)."""
    arr = np.asarray(ttfts, dtype=float)
    good = int((arr <= bound_s).sum()) if len(arr) else 0
    return {
        "offered": offered,
        "completed": len(ttfts),
        "goodput": good,
        "goodput_share": good / offered if offered else 0.0,
        "refused": refused,
        "refused_with_retry_after": refused_with_retry,
        "other_errors": other_errors,
        "lost": lost,
        "ttft_p50_s": float(np.percentile(arr, 50)) if len(arr) else math.nan,
        "ttft_p99_s": float(np.percentile(arr, 99)) if len(arr) else math.nan,
    }


def run_sim(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    from kvrelay.sim.cluster_config import load_cluster_config
    from kvrelay.sim.replay import ReplayOptions, replay
    from kvrelay.sim.trace import load_trace

    requests = load_trace(args.trace, limit=args.limit)
    cluster = load_cluster_config(None)
    systems = {"no_queue": QUEUE_OFF, "queue_defaults": Limits(), "queue_tuned": tuned(args.ttft_bound_s)}
    out = {}
    for name, limits in systems.items():
        config = RouterConfig(chunk_tokens=cluster.chunk_tokens, queue=limits)
        m = replay(requests, cluster, "kvrelay", ReplayOptions(seed=args.seed, rate_scale=args.rate_scale), config)
        errors = dict(m["errors"])
        refused = errors.pop("queue_full", 0)
        lost = m["requests"] - m["answered_once"]
        ttfts = m["ttft_samples_s"]
        out[name] = summary(
            ttfts, refused, m["refused_with_retry_after"], sum(errors.values()), lost, args.ttft_bound_s, m["requests"]
        )
        print(f"sim {name}: {out[name]}", flush=True)
    return out


LIVE_MODEL = dict(
    hidden_size=384,
    intermediate_size=1024,
    num_hidden_layers=6,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=4096,
)
"""A small random Llama: big enough that the workers, not the router or the client, are the bottleneck."""
PROMPT_TOKENS = 384
MAX_TOKENS = 8
LANES = 4


class LiveSystem:
    """One ``kvrelay router`` and its workers, as child processes (logs under ``work/name``)."""

    def __init__(self, name: str, work: Path, model: Path, workers: int, flags: list[str]) -> None:
        import os
        import secrets
        import sys

        from kvrelay.launch.child import ChildProcess
        from kvrelay.launch.cluster import ROUTER_READY, WORKER_READY

        home = work / name
        home.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVRELAY_")}
        env.update(
            KVRELAY_SECRET=secrets.token_urlsafe(32),
            KVRELAY_CACHE_DIR=str(home / "cache"),
            KVRELAY_DATA_DIR=str(home / "data"),
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
        )
        cli = [sys.executable, "-m", "kvrelay.cli.main"]
        db = f"sqlite:///{home / 'facts.sqlite3'}"
        router_argv = [*cli, "router", "--port", "0", "--worker-port", "0", "--model", str(model), "--db", db, *flags]
        self.router = ChildProcess(f"{name}-router", router_argv, env)
        self.children = [self.router]
        ready = self.router.wait_for(ROUTER_READY, 120)
        self.http_url, workers_url = ready.group(1), ready.group(2)
        for i in range(workers):
            argv = [*cli, "worker", "--worker-id", f"w{i}", "--router", workers_url, "--model", str(model)]
            argv += ["--dtype", "float32", "--kv-tokens", "16384", "--lanes", str(LANES), "--heartbeat-s", "0.25"]
            self.children.append(ChildProcess(f"{name}-w{i}", argv, env))
        for child in self.children[1:]:
            child.wait_for(WORKER_READY, 180)

    def close(self) -> None:
        for child in reversed(self.children):
            child.stop(30)


def _classify(answers: list[Any]) -> dict[str, Any]:
    """Counts and TTFTs of one round's answers (``open_loop.Answer``)."""
    ttfts = [a.ttft_s for a in answers if a.status == 200 and a.ttft_s is not None and a.finish_reason]
    refusals = [a for a in answers if a.status == 429]
    with_retry = [
        a
        for a in refusals
        if a.retry_after
        and a.retry_after.isdigit()
        and int(a.retry_after) >= 1
        and isinstance(a.error_body, dict)
        and a.error_body.get("type") == "rate_limit_error"
    ]
    lost = sum(a.status is None and a.error is None for a in answers) + sum(
        a.status == 200 and not a.finish_reason for a in answers
    )
    other = len(answers) - len(ttfts) - len(refusals) - lost
    errors = Counter(
        (a.error or str(a.error_body))[:160]
        for a in answers
        if a.status not in (200, 429) and (a.error or a.error_body)
    )
    return {
        "ttfts": ttfts,
        "refused": len(refusals),
        "with_retry": len(with_retry),
        "other": other,
        "lost": lost,
        "errors": dict(errors),
    }


def run_live(args: argparse.Namespace) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    import random
    import tempfile

    from kvrelay.bench.open_loop import closed_loop_rate, open_loop
    from kvrelay.testing.tiny_models import make_tiny_model

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="kvrelay-overload-"))
    model = make_tiny_model("llama", work / "small-llama", **LIVE_MODEL)
    bound = args.live_ttft_bound_s
    limits = tuned(bound)
    off = ["--queue-start-within-s", "inf", "--queue-max-wait-s", "inf"]
    on = ["--queue-start-within-s", f"{limits.start_within_s:g}", "--queue-max-wait-s", f"{limits.max_wait_s:g}"]
    rng = random.Random(args.seed)

    def prompts(n: int) -> list[list[int]]:
        return [[rng.randrange(10, 384) for _ in range(PROMPT_TOKENS)] for _ in range(n)]

    systems: dict[str, LiveSystem] = {}
    try:
        systems["no_queue"] = LiveSystem("no_queue", work, model, args.workers, off)
        systems["queue"] = LiveSystem("queue", work, model, args.workers, on)
        concurrency = 2 * LANES * args.workers
        for system in systems.values():  # warm both: the first requests pay one-off costs
            closed_loop_rate(system.http_url, model.name, prompts(concurrency), concurrency, MAX_TOKENS)
        capacity = closed_loop_rate(
            systems["no_queue"].http_url, model.name, prompts(4 * concurrency), concurrency, MAX_TOKENS
        )
        rate = args.overload * capacity
        print(f"live: capacity {capacity:.2f} completions/s; arrivals at {rate:.2f}/s", flush=True)
        rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in systems}
        for r in range(args.rounds):
            n = max(1, round(rate * args.round_s))
            gaps = np.cumsum([rng.expovariate(rate) for _ in range(n)]).tolist()
            batch = prompts(n)
            order = list(systems) if r % 2 == 0 else list(reversed(systems))
            for name in order:
                answers = open_loop(systems[name].http_url, model.name, batch, gaps, MAX_TOKENS)
                rounds[name].append(_classify(answers) | {"offered": n})
                c = rounds[name][-1]
                good = sum(t <= bound for t in c["ttfts"])
                print(
                    f"live round {r} {name}: offered {n}, goodput {good}, refused {c['refused']}, "
                    f"errors {c['errors'] or 'none'}",
                    flush=True,
                )
    finally:
        for system in systems.values():
            system.close()
    results = {}
    for name, rs in rounds.items():
        ttfts = [t for c in rs for t in c["ttfts"]]
        results[name] = summary(
            ttfts,
            sum(c["refused"] for c in rs),
            sum(c["with_retry"] for c in rs),
            sum(c["other"] for c in rs),
            sum(c["lost"] for c in rs),
            bound,
            sum(c["offered"] for c in rs),
        )
    per_round = [
        sum(t <= bound for t in q["ttfts"]) / max(1, sum(t <= bound for t in o["ttfts"]))
        for q, o in zip(rounds["queue"], rounds["no_queue"], strict=True)
    ]
    title = (
        f"{args.workers} worker(s) of a small random Llama, capacity {capacity:.2f}/s, arrivals "
        f"{args.overload:g}x that, {args.rounds} alternating rounds of {args.round_s:g} s"
    )
    ratios = {"goodput_ratio_round_min": min(per_round), "goodput_ratio_round_max": max(per_round)}
    return results, {"title": title, "ratios": ratios, "capacity_per_s": capacity}


def table(title: str, results: dict[str, dict[str, Any]], bound_s: float) -> str:
    head = (
        f"{'system':<16}{'offered':>8}{'goodput':>9}{'share':>8}{'refused':>9}{'w/ Retry':>9}{'errors':>8}"
        f"{'lost':>6}{'p50 TTFT':>10}{'p99 TTFT':>10}"
    )
    lines = [f"{title} (goodput: TTFT <= {bound_s:g} s)", head, "-" * len(head)]
    for name, r in results.items():
        lines.append(
            f"{name:<16}{r['offered']:>8}{r['goodput']:>9}{r['goodput_share']:>8.1%}{r['refused']:>9}"
            f"{r['refused_with_retry_after']:>9}{r['other_errors']:>8}{r['lost']:>6}{r['ttft_p50_s']:>9.2f}s"
            f"{r['ttft_p99_s']:>9.2f}s"
        )
    return "\n".join(lines)


def figures(
    prefix: str, results: dict[str, dict[str, Any]], system: str, extra: dict[str, float] | None = None
) -> list[Figure]:
    r, base = results[system], results["no_queue"]
    out = [
        Figure(f"{prefix}_goodput_share", r["goodput_share"], "share", "no_queue", base["goodput_share"]),
        Figure(f"{prefix}_goodput", r["goodput"], "requests", "no_queue", base["goodput"]),
        Figure(f"{prefix}_refused", r["refused"], "requests", "no_queue", base["refused"]),
        Figure(f"{prefix}_refused_without_retry_after", r["refused"] - r["refused_with_retry_after"], "requests"),
        Figure(f"{prefix}_lost", r["lost"], "requests", "no_queue", base["lost"]),
        Figure(f"{prefix}_ttft_p50_s", r["ttft_p50_s"], "s", "no_queue", base["ttft_p50_s"]),
    ]
    for name, value in (extra or {}).items():
        out.append(Figure(f"{prefix}_{name}", value, "ratio"))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sim", action="store_true", help="run the simulator part (default: both parts)")
    p.add_argument("--live", action="store_true", help="run the live part (default: both parts)")
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests (sim)")
    p.add_argument("--rate-scale", type=float, default=6.0, help="sim: replay the trace this much faster")
    p.add_argument("--ttft-bound-s", type=float, default=5.0, help="sim: the TTFT bound of goodput")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--live-ttft-bound-s", type=float, default=2.0, help="live: the TTFT bound of goodput")
    p.add_argument("--overload", type=float, default=3.0, help="live: arrivals at this many times the capacity")
    p.add_argument("--rounds", type=int, default=3, help="live: rounds per system, alternating")
    p.add_argument("--round-s", type=float, default=20.0, help="live: seconds of arrivals per round")
    p.add_argument("--workers", type=int, default=1, help="live: workers per system")
    p.add_argument(
        "--work-dir", type=Path, default=None, help="live: where the model and logs go (default: a temp dir)"
    )
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    both = not args.sim and not args.live
    figs: list[Figure] = []
    texts = []
    if args.sim or both:
        sim = run_sim(args)
        texts.append(
            table(f"simulator: {args.trace.name} at {args.rate_scale:g}x, kvrelay policy", sim, args.ttft_bound_s)
        )
        figs += figures("sim_defaults", sim, "queue_defaults")
        figs += figures("sim_tuned", sim, "queue_tuned")
    if args.live or both:
        live, meta = run_live(args)
        texts.append(table(f"live: {meta['title']}", live, args.live_ttft_bound_s))
        figs += figures("live", live, "queue", meta["ratios"])
    print("\n\n".join(texts))
    report("overload: the router queue against none", figs, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
