"""Predict on route in the simulator: kvrelay with and without it, on a trace's bursts of shared prefixes.

Replays a Mooncake-format trace (default: the development trace at 2x its rate,
the default cluster) under kvrelay's policy twice: as built (the router credits
a routed request's chunks as pending; workers re-match a prefix when its
prefill starts) and with both switched off (``ReplayOptions.predict_on_route``
and ``share_prefill`` False). Reports mean and p99 TTFT and recomputed tokens
over all requests and over the *followers*: requests that share at least their
first block with a request that arrived less than ``--window-s`` seconds
before them (on the replay clock), i.e. the ones that can arrive while their
predecessor is still prefilling.

Run: ``.venv/bin/python bench/predict_on_route.py --json bench/results/predict_on_route.json``
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from kvrelay.bench.report import Figure, report
from kvrelay.sim.cluster_config import load_cluster_config
from kvrelay.sim.replay import ReplayOptions, replay
from kvrelay.sim.trace import TraceRequest, load_trace

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "data" / "traces" / "mooncake_synthetic_trace.jsonl"


def followers(requests: list[TraceRequest], rate_scale: float, window_s: float) -> set[str]:
    """Request ids (``t<line>``) that share their first block with a request that arrived within ``window_s``."""
    last_seen: dict[int, float] = {}
    out: set[str] = set()
    for r in requests:
        at = r.timestamp_ms / 1000.0 / rate_scale
        first = r.hash_ids[0]
        if first in last_seen and at - last_seen[first] < window_s:
            out.add(f"t{r.line}")
        last_seen[first] = at
    return out


def stats(metrics: dict[str, Any], ids: set[str] | None) -> dict[str, float]:
    by_request = metrics["ttft_by_request_s"]
    ttfts = np.asarray([t for rid, t in by_request.items() if ids is None or rid in ids])
    return {"n": float(len(ttfts)), "mean": float(ttfts.mean()), "p99": float(np.percentile(ttfts, 99))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--config", default=None, help="cluster config (default configs/cluster-default.toml)")
    p.add_argument("--rate-scale", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--window-s", type=float, default=5.0)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    requests = load_trace(args.trace, limit=args.limit)
    cluster = load_cluster_config(args.config)
    ids = followers(requests, args.rate_scale, args.window_s)
    runs = {}
    for name, on in (("with", True), ("without", False)):
        options = ReplayOptions(seed=args.seed, rate_scale=args.rate_scale, predict_on_route=on, share_prefill=on)
        m = replay(requests, cluster, "kvrelay", options)
        runs[name] = {"all": stats(m, None), "followers": stats(m, ids), "recomputed_tokens": m["recomputed_tokens"]}
    print(
        f"{len(requests)} requests, {len(ids)} followers (first block shared within {args.window_s:g} s), "
        f"rate x{args.rate_scale:g}"
    )
    print(f"{'':<9}{'mean':>9}{'p99':>9}{'followers mean':>16}{'p99':>9}{'recomputed':>14}")
    for name, r in runs.items():
        a, f = r["all"], r["followers"]
        print(
            f"{name:<9}{a['mean']:>9.3f}{a['p99']:>9.3f}{f['mean']:>16.3f}{f['p99']:>9.3f}{r['recomputed_tokens']:>14,}"
        )
    w, wo = runs["with"], runs["without"]
    figures = [
        Figure("ttft_mean_s", w["all"]["mean"], "s", "without", wo["all"]["mean"]),
        Figure("ttft_p99_s", w["all"]["p99"], "s", "without", wo["all"]["p99"]),
        Figure("followers_ttft_mean_s", w["followers"]["mean"], "s", "without", wo["followers"]["mean"]),
        Figure("followers_ttft_p99_s", w["followers"]["p99"], "s", "without", wo["followers"]["p99"]),
        Figure("recomputed_tokens", w["recomputed_tokens"], "tokens", "without", wo["recomputed_tokens"]),
    ]
    report("predict on route (kvrelay sim, kvrelay policy)", figures, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
