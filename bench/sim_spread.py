"""Simulated TTFT of kvrelay's policy against the peers', over several replays with slightly moved arrivals.

One replay of a saturated cluster is chaotic: a single request routed
differently changes every later queue, so two policies' figures of one replay
can differ by more than their routing does. This bench replays every cell
(regime x rate) ``--replays`` times: replay 0 is the trace as recorded, replay
i > 0 moves each arrival within +-``--jitter-ms`` (``sim.trace.jitter_arrivals``,
seed i; the network model keeps seed 0). Every policy runs every replay. Per
cell and figure (mean, p99 TTFT) it prints each policy's median and range, the
best peer by median, the paired ratio best peer / kvrelay (median and range
over replays; above 1 kvrelay is faster) and in how many replays kvrelay had
the lowest figure (``bench.spread``).

Run: ``.venv/bin/python bench/sim_spread.py --json bench/results/sim_spread.json``
(about 20 minutes on 2 cores with the default five policies and five replays).
"""

from __future__ import annotations

import argparse
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from kvrelay.bench.report import Figure, report
from kvrelay.bench.spread import Comparison, Run, Stat, summarize
from kvrelay.core.policies import POLICY_NAMES
from kvrelay.sim.cluster_config import load_cluster_config
from kvrelay.sim.replay import ReplayOptions, replay
from kvrelay.sim.trace import jitter_arrivals, load_trace

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "data" / "traces" / "mooncake_synthetic_trace.jsonl"
SUBJECT = "kvrelay"
DEFAULT_POLICIES = "kvrelay,mooncake,llm_d,dynamo,sglang_cache_aware"
"""kvrelay and the peers with the lowest figure of some cell in the single-replay tables (README → Results)."""


def one_run(trace: str, config: str, rate: float, policy: str, index: int, jitter_ms: float, limit: int | None) -> Run:
    """Replay ``index`` of one cell under ``policy``."""
    cluster = load_cluster_config(ROOT / "configs" / f"cluster-{config}.toml")
    requests = load_trace(trace, limit=limit)
    requests = jitter_arrivals(requests, jitter_ms if index else 0.0, index)
    m = replay(requests, cluster, policy, ReplayOptions(rate_scale=rate))
    return Run(policy, index, m["ttft_s"]["mean"], m["ttft_s"]["p99"], m["completed"])


def _cell_lines(cell: str, comparisons: dict[Stat, Comparison]) -> list[str]:
    lines = []
    for stat, c in comparisons.items():
        lines.append(
            f"{cell:<18}{stat.value:<5} best peer {c.best_peer:<20} best peer / kvrelay {c.ratio.median:.3f}x "
            f"[{c.ratio.least:.3f}, {c.ratio.largest:.3f}]  kvrelay lowest in {c.wins}/{c.replays}"
        )
        for policy, s in c.by_policy.items():
            lines.append(f"{'':<23}{policy:<20} median {s.median:8.3f} s  [{s.least:.3f}, {s.largest:.3f}]")
    return lines


def _plot(results: dict[str, list[Run]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = list(results)
    fig, axes = plt.subplots(2, len(cells), figsize=(3.2 * len(cells), 6.5), dpi=110, squeeze=False)
    for col, cell in enumerate(cells):
        runs = results[cell]
        policies = list(dict.fromkeys(r.policy for r in runs))
        for row, stat in enumerate(Stat):
            ax = axes[row][col]
            for x, policy in enumerate(policies):
                ys = [r.value(stat) for r in runs if r.policy == policy]
                ax.scatter([x] * len(ys), ys, s=14, color="C3" if policy == SUBJECT else "C0", alpha=0.7)
            ax.set_xticks(range(len(policies)))
            ax.set_xticklabels(policies, rotation=60, ha="right", fontsize=7)
            ax.set_title(f"{cell}: {stat.value} TTFT", fontsize=8)
            ax.grid(True, axis="y", alpha=0.3)
    axes[0][0].set_ylabel("seconds, one dot per replay")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--configs", default="default,vllm-fleet,heterogeneous", help="regimes: configs/cluster-NAME.toml")
    p.add_argument("--rates", default="1,2", help="rate scales (default 1,2)")
    p.add_argument("--policies", default=DEFAULT_POLICIES, help=f"kvrelay and peers (default {DEFAULT_POLICIES})")
    p.add_argument("--replays", type=int, default=5, help="replays per cell; 0 is the trace as recorded (default 5)")
    p.add_argument("--jitter-ms", type=float, default=20.0, help="arrivals move within +-this (default 20 ms)")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests (smoke runs)")
    p.add_argument("--procs", type=int, default=2, help="replays run at once (default 2)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here (and a PNG next to it)")
    args = p.parse_args(argv)
    policies = [s for s in args.policies.split(",") if s]
    unknown = [s for s in policies if s not in POLICY_NAMES]
    if unknown:
        p.error(f"unknown policies {unknown}; known: {', '.join(POLICY_NAMES)}")
    if SUBJECT not in policies or len(policies) < 2:
        p.error(f"--policies must hold '{SUBJECT}' and at least one peer")
    if args.replays < 1 or args.procs < 1:
        p.error("--replays and --procs must be at least 1")
    configs = [s for s in args.configs.split(",") if s]
    for name in configs:
        if not (ROOT / "configs" / f"cluster-{name}.toml").is_file():
            p.error(f"no cluster config configs/cluster-{name}.toml")
    rates = [float(s) for s in args.rates.split(",") if s]
    tasks = [
        (f"{config} x{rate:g}", (str(args.trace), config, rate, policy, i, args.jitter_ms, args.limit))
        for config in configs
        for rate in rates
        for i in range(args.replays)
        for policy in policies
    ]
    results: dict[str, list[Run]] = {}
    with ProcessPoolExecutor(args.procs) as pool:
        futures = [(cell, pool.submit(one_run, *task)) for cell, task in tasks]
        for cell, future in futures:
            results.setdefault(cell, []).append(future.result())
    print(
        f"{args.trace.name}: {args.replays} replays per cell (arrivals moved within +-{args.jitter_ms:g} ms "
        "in replays 1 on)"
    )
    figures: list[Figure] = []
    for cell, runs in results.items():
        comparisons = dict(summarize(runs, SUBJECT))
        print("\n".join(_cell_lines(cell, comparisons)))
        key = cell.replace(" ", "_")
        for stat, c in comparisons.items():
            own = c.by_policy[SUBJECT]
            peer = c.by_policy[c.best_peer]
            figures += [
                Figure(f"{key}_{stat.value}_ttft_s_median", own.median, "s", c.best_peer, peer.median),
                Figure(f"{key}_{stat.value}_ratio_median", c.ratio.median, "x", "best peer per replay", 1.0),
                Figure(f"{key}_{stat.value}_ratio_least", c.ratio.least, "x"),
                Figure(f"{key}_{stat.value}_ratio_largest", c.ratio.largest, "x"),
                Figure(f"{key}_{stat.value}_kvrelay_lowest_replays", c.wins, "replays", "replays", c.replays),
            ]
    report("kvrelay against the peers over moved-arrival replays (kvrelay sim)", figures, args.json and str(args.json))
    if args.json:
        png = args.json.with_suffix(".png")
        _plot(results, png)
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
