"""``kvrelay sim``: replay a Mooncake-format trace through the router under logical time.

Prints one table row per policy (TTFT, prefix-hit share and its ratio to the
trace's chunk-level infinite-cache bound, recomputed tokens, load imbalance), both
bounds (by blocks and by routable chunks) and the load per worker; ``--json PATH``
writes::

    {"trace": str, "workers": int, "seed": int,
     "policies": {NAME: {"requests", "completed", "ttft_s": {"mean", "p50", "p90", "p99"},
                         "prefix_hit_share", "infinite_cache_bound", "chunk_cache_bound",
                         "bound_ratio", "chunk_bound_ratio", "recomputed_tokens",
                         "reuse": {"available_tokens", "captured_tokens", "delivered_tokens",
                                   "captured_share", "delivered_share"}, ...}}}

The ``captured`` and ``delivered`` columns are the routing's decision quality (``core.router.reuse``): the
cached tokens of the chosen routes, and those the workers restored or found, as shares of the longest prefix
held anywhere at each routing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvrelay.core.policies import DEFAULT_POLICY
from kvrelay.core.router.queue import QUEUE_OFF, Limits
from kvrelay.core.router.state import RouterConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True, help="Mooncake-format JSONL trace file")
    parser.add_argument("--workers", type=int, default=None, help="number of workers (default: from the config)")
    parser.add_argument(
        "--policy", default=DEFAULT_POLICY, help=f"routing policy name, or 'all' (default {DEFAULT_POLICY})"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the network model, the router and --arrival-jitter-ms (default 0)"
    )
    parser.add_argument("--rate-scale", type=float, default=1.0, help="replay X times faster (default 1)")
    parser.add_argument(
        "--arrival-jitter-ms",
        type=float,
        default=0.0,
        help="move each arrival by a uniform draw within +-this many ms, seeded by --seed (default 0: as traced)",
    )
    parser.add_argument("--block-tokens", type=int, default=512, help="tokens per trace block (default 512)")
    parser.add_argument("--config", default=None, help="cluster config TOML (default configs/cluster-default.toml)")
    parser.add_argument(
        "--calibration",
        default=None,
        help="calibration TOML of measured costs laid over the cluster config "
        "(e.g. configs/calibration-gemma3-270m-cpu.toml, written by bench/calibrate.py)",
    )
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    parser.add_argument("--delta-tokens", type=int, default=16, help="tokens per streamed delta (default 16)")
    parser.add_argument(
        "--plot",
        dest="plot_path",
        default=None,
        help="write a PNG of the TTFT distribution per policy (default with --json and several "
        "policies: the JSON path with .png)",
    )
    queue = parser.add_argument_group("router queue (docs/design.md section 6)")
    queue.add_argument(
        "--no-router-queue",
        action="store_true",
        help="send every request to a worker as soon as one has room (no router queue, no 429s)",
    )
    queue.add_argument(
        "--queue-start-within-s",
        type=float,
        default=None,
        help="a request waits at the router while no worker would start it within this many seconds (default 2)",
    )
    queue.add_argument(
        "--queue-max-requests", type=int, default=None, help="most requests waiting per model (default 4096)"
    )
    queue.add_argument(
        "--queue-max-wait-s",
        type=float,
        default=None,
        help="refuse a new request when the predicted work ahead of it, per worker, exceeds this (default 30)",
    )
    parser.add_argument("--json", dest="json_path", default=None, help="write the results as JSON to this path")
    parser.add_argument(
        "--log", dest="log_path", default=None, help="write the byte-stable event log to this path (one policy only)"
    )


def queue_limits(args: argparse.Namespace) -> Limits:
    """The router queue's bounds from the flags (``QUEUE_OFF`` with --no-router-queue); ValueError names a bad one."""
    if args.no_router_queue:
        return QUEUE_OFF
    given = {
        "start_within_s": args.queue_start_within_s,
        "max_requests": args.queue_max_requests,
        "max_wait_s": args.queue_max_wait_s,
    }
    return Limits(**{k: v for k, v in given.items() if v is not None})


def _policies(name: str) -> tuple[str, ...]:
    from kvrelay.core.policies import POLICY_NAMES

    if name == "all":
        return POLICY_NAMES
    if name not in POLICY_NAMES:
        raise ValueError(f"policy '{name}' is unknown; known policies: {', '.join(POLICY_NAMES)}, or 'all'")
    return (name,)


def format_table(results: dict[str, dict[str, Any]]) -> str:
    """The comparison table, one row per policy, then the load per worker."""
    width = max(14, *(len(name) + 2 for name in results))
    head = (
        f"{'policy':<{width}}{'requests':>9}{'done':>7}{'ttft mean':>11}{'p50':>9}{'p90':>9}{'p99':>9}"
        f"{'hit share':>10}{'of bound':>9}{'captured':>9}{'delivered':>10}{'recomputed':>13}{'imbalance':>10}"
        f"{'wall s':>8}"
    )
    lines = [head, "-" * len(head)]
    for name, m in results.items():
        t = {k: "-" if v is None else f"{v:.3f}s" for k, v in m["ttft_s"].items()}
        lines.append(
            f"{name:<{width}}{m['requests']:>9}{m['completed']:>7}{t['mean']:>11}{t['p50']:>9}{t['p90']:>9}"
            f"{t['p99']:>9}{m['prefix_hit_share']:>10.1%}{m['chunk_bound_ratio']:>9.1%}"
            f"{m['reuse']['captured_share']:>9.1%}{m['reuse']['delivered_share']:>10.1%}{m['recomputed_tokens']:>13,}"
            f"{m['load_imbalance']:>10.2f}{m['wall_s']:>8.1f}"
        )
    first = next(iter(results.values()))
    lines.append(
        f"infinite-cache bound: {first['chunk_cache_bound']:.1%} of prompt tokens by routable chunks "
        f"('of bound'), {first['infinite_cache_bound']:.1%} by whole blocks"
    )
    lines.append(
        "captured, delivered: reuse the chosen routes captured and the workers delivered, of the longest prefix "
        "held anywhere at each routing"
    )
    lines.append("")
    lines.append("load per worker (accepted attempts / busy seconds):")
    for name, m in results.items():
        cells = "  ".join(f"{wid} {w['accepted']}/{w['busy_s']:.0f}s" for wid, w in m["per_worker"].items())
        lines.append(f"  {name:<{width}}{cells}")
    for name, m in results.items():
        if m["errors"] or not m["drained"]:
            lines.append(f"  {name}: errors {m['errors']}, drained {m['drained']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from kvrelay.sim.calibration import (
        CalibrationError,
        apply_calibration,
        load_calibration,
    )
    from kvrelay.sim.cluster_config import (
        ClusterConfigError,
        load_cluster_config,
    )
    from kvrelay.sim.replay import ReplayOptions, replay, with_workers
    from kvrelay.sim.trace import TraceError, jitter_arrivals, load_trace

    try:
        if args.workers is not None and args.workers < 1:
            raise ValueError(f"--workers must be at least 1, got {args.workers}")
        if args.limit is not None and args.limit < 1:
            raise ValueError(f"--limit must be at least 1, got {args.limit}")
        if args.rate_scale <= 0:
            raise ValueError(f"--rate-scale must be positive, got {args.rate_scale}")
        policies = _policies(args.policy)
        if args.log_path and len(policies) > 1:
            raise ValueError("--log needs a single --policy (the log is per run)")
        cluster = load_cluster_config(args.config)
        if args.calibration is not None:
            cluster = apply_calibration(cluster, load_calibration(args.calibration))
        cluster = with_workers(cluster, args.workers)
        requests = jitter_arrivals(
            load_trace(args.trace, args.block_tokens, args.limit), args.arrival_jitter_ms, args.seed
        )
        options = ReplayOptions(
            seed=args.seed,
            rate_scale=args.rate_scale,
            block_tokens=args.block_tokens,
            delta_tokens=args.delta_tokens,
            log_path=args.log_path,
        )
        config = RouterConfig(chunk_tokens=cluster.chunk_tokens, queue=queue_limits(args))
        results = {name: replay(requests, cluster, name, options, config) for name in policies}
    except (TraceError, ClusterConfigError, CalibrationError, ValueError) as exc:
        print(f"kvrelay sim: {exc}", file=sys.stderr)
        return 2
    moved = f", arrivals moved within +-{args.arrival_jitter_ms:g} ms" if args.arrival_jitter_ms else ""
    print(
        f"trace {args.trace}: {len(requests)} requests, {cluster.workers} workers, seed {args.seed}, "
        f"rate x{args.rate_scale:g}{moved}"
    )
    print(format_table(results))
    samples = {name: m.pop("ttft_samples_s") for name, m in results.items()}
    for m in results.values():
        m.pop("ttft_by_request_s")
    if args.plot_path or (args.json_path and len(policies) > 1):
        from kvrelay.sim.plot import plot_ttft

        png = args.plot_path or str(Path(args.json_path).with_suffix(".png"))
        plot_ttft(samples, png, f"{Path(args.trace).name}, {cluster.workers} workers, rate x{args.rate_scale:g}")
        print(f"wrote {png}")
    if args.json_path:
        doc = {"trace": str(args.trace), "workers": cluster.workers, "seed": args.seed, "policies": results}
        Path(args.json_path).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json_path}")
    return 0
