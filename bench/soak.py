"""A bounded soak: random fault schedules, drawn from a printed seed, against a steady load on a cluster across
network namespaces; the invariant checker judges every schedule.

The cluster is ``kvrelay.testing.netns_cluster``'s (router, three workers, PostgreSQL, S3, a client and a proxy,
each on a host of its own; needs root, iproute2, nftables and PostgreSQL 15). Each round streams requests to the
counting model at ``--rate`` per second (at most ``--in-flight`` at once; prompts share the prefixes of a few
documents, so chunks are restored from every tier), injects one fault a few seconds in, holds it, heals it, stops
the load, waits for every stream to end and runs ``kvrelay.testing.invariants.check``. The first rounds inject
every fault kind once, in a seeded order; later ones draw kinds at random. The table: faults injected by kind,
requests, completed, failed with a clear error, lost (must be 0), duplicated tokens (must be 0), TTFT p50/p99 of
the completed requests, and the invariant violations found (must be 0).

    sudo .venv/bin/python bench/soak.py [--minutes 8] [--seed N] [--json bench/results/soak.json]
        [--md bench/results/soak.md] [--png bench/results/soak.png]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvrelay.bench.report import Figure, report
from kvrelay.testing import netfaults
from kvrelay.testing.counting_model import word_prompt
from kvrelay.testing.invariants import End, Verdict
from kvrelay.testing.lab_services import postgres_missing
from kvrelay.testing.netns import Host, unavailable_reason
from kvrelay.testing.netns_cluster import LabCluster, Schedule
from kvrelay.testing.streams import StreamLoad, StreamRecord

FAULT_KINDS = (
    "loss",
    "rate_limit",
    "delay_jitter",
    "partition",
    "blackhole",
    "link_down",
    "freeze",
    "kill_worker",
    "kill_router",
    "disk_full",
)
DOCUMENTS = 6
"""Prompts start at one of this many places of the word cycle, so they share prefixes."""


@dataclass
class Round:
    index: int
    kind: str
    fault: str
    records: list[StreamRecord]
    verdict: Verdict
    seconds: float
    fault_span: tuple[float, float] = (0.0, 0.0)
    """When the fault was on (monotonic seconds)."""


@dataclass
class SoakResult:
    seed: int
    rounds: list[Round] = field(default_factory=list)

    def records(self) -> list[StreamRecord]:
        return [r for rnd in self.rounds for r in rnd.records]

    def count(self, end: End) -> int:
        return sum(rnd.verdict.count(end) for rnd in self.rounds)

    def violations(self) -> list[str]:
        return [f"round {rnd.index} ({rnd.fault}): {v}" for rnd in self.rounds for v in rnd.verdict.violations]

    def ttfts(self) -> list[float]:
        return sorted(
            r.ttft_s
            for rnd in self.rounds
            for r in rnd.records
            if rnd.verdict.ends.get(r.index) == End.COMPLETED and r.ttft_s is not None
        )


def _upstream(cluster: LabCluster, wid: str) -> Host:
    """The host ``wid``'s router link leads to first: the proxy for the proxied worker, else the router."""
    return cluster.hosts["proxy" if wid == cluster.settings.proxied else "router"]


def inject(kind: str, cluster: LabCluster, rng: random.Random) -> tuple[str, Callable[[], None]]:
    """Start one fault of ``kind`` on a victim drawn from ``rng``; its description and the call that heals it."""
    workers = list(cluster.settings.workers)
    wid = rng.choice(workers)
    host = cluster.hosts[wid]
    if kind == "loss":
        percent = rng.choice((2, 5, 10, 20))
        netfaults.drop_random(host, percent)
        return f"{percent}% packet loss on {wid}", lambda: netfaults.heal(host)
    if kind == "rate_limit":
        rate = rng.choice(("512kbit", "1mbit", "4mbit"))
        netfaults.limit_rate(host, rate)
        return f"{wid} egress limited to {rate}", lambda: netfaults.heal(host)
    if kind == "delay_jitter":
        assert cluster.proxy is not None and cluster.settings.proxied is not None
        base, jitter = rng.choice((0.01, 0.05, 0.1)), rng.choice((0.05, 0.2, 0.4))
        cluster.proxy.delay(base, jitter)
        return f"{cluster.settings.proxied}'s link delayed {base}+U(0,{jitter}) s", cluster.proxy.heal
    if kind == "partition":
        up = _upstream(cluster, wid)
        netfaults.partition(host, up)
        return f"{wid} -> {up.name} dropped (nftables)", lambda: netfaults.heal(host)
    if kind == "blackhole":
        up = _upstream(cluster, wid)
        netfaults.blackhole(up, host)
        return f"{up.name} -> {wid} blackholed (route)", lambda: netfaults.heal(up)
    if kind == "link_down":
        netfaults.cable(host, False)
        return f"{wid}'s link down", lambda: netfaults.cable(host, True)
    if kind == "freeze":
        cluster.freeze(wid)
        return f"{wid} frozen (SIGSTOP)", lambda: cluster.thaw(wid)
    if kind == "kill_worker":
        cluster.kill(wid)
        return f"kill -9 {wid}", lambda: cluster.start_worker(wid)
    if kind == "kill_router":
        cluster.kill("router")
        return "kill -9 router", cluster.start_router
    if kind == "disk_full":
        victim = cluster.settings.small_disk
        assert victim is not None
        cluster.fill_disk(victim)
        return f"{victim}'s chunk directory full", lambda: cluster.free_disk(victim)
    raise ValueError(f"unknown fault kind {kind!r}; kinds: {', '.join(FAULT_KINDS)}")


def steady_load(
    load: StreamLoad, rng: random.Random, rate: float, in_flight: int, until: float, max_tokens: int
) -> threading.Thread:
    """Submit requests at ``rate`` per second (Poisson arrivals), at most ``in_flight`` open, until ``until``."""

    def run() -> None:
        while time.monotonic() < until:
            if load.in_flight() < in_flight:
                doc = rng.randrange(DOCUMENTS)
                prompt = word_prompt(41 * doc, rng.randrange(65, 230))
                load.submit(prompt, rng.randrange(8, max_tokens + 1))
            time.sleep(min(rng.expovariate(rate), max(0.0, until - time.monotonic())))

    thread = threading.Thread(target=run, name="soak-load", daemon=True)
    thread.start()
    return thread


def run_round(
    cluster: LabCluster, index: int, kind: str, rng: random.Random, args: argparse.Namespace, log: Callable[[str], None]
) -> Round:
    """One fault schedule under load, judged by the checker once every stream has ended."""
    started = time.monotonic()
    schedule = Schedule(cluster)
    load = cluster.load()
    end = started + args.round_s
    feeder = steady_load(load, random.Random(rng.random()), args.rate, args.in_flight, end, args.max_tokens)
    time.sleep(rng.uniform(2.0, 5.0))
    fault_at = time.monotonic()
    fault, heal = inject(kind, cluster, rng)
    log(f"round {index}: {fault}")
    try:
        time.sleep(rng.uniform(3.0, 9.0))
    finally:
        heal()
    healed_at = time.monotonic()
    feeder.join()
    records = load.wait(args.stream_end_s)
    cluster.heal_network()
    cluster.wait_live(cluster.settings.workers, 120)
    verdict = schedule.verify(records)
    took = time.monotonic() - started
    log(
        f"round {index}: {len(records)} requests, {verdict.count(End.COMPLETED)} completed, "
        f"{verdict.count(End.FAILED)} failed, {verdict.count(End.LOST)} lost, "
        f"{len(verdict.violations)} violations ({took:.0f} s)"
    )
    for violation in verdict.violations:
        log(f"  VIOLATION {violation}")
    return Round(index, kind, fault, records, verdict, took, (fault_at, healed_at))


def run_soak(
    cluster: LabCluster, seed: int, args: argparse.Namespace, log: Callable[[str], None] = print
) -> SoakResult:
    """Rounds until ``args.minutes`` passed and every kind of ``args.kinds`` was injected once (see the docstring)."""
    rng = random.Random(seed)
    first = list(args.kinds)
    rng.shuffle(first)
    result = SoakResult(seed)
    deadline = time.monotonic() + 60 * args.minutes
    index = 0
    while first or time.monotonic() < deadline:
        kind = first.pop(0) if first else rng.choice(args.kinds)
        result.rounds.append(run_round(cluster, index, kind, rng, args, log))
        index += 1
    return result


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(q * len(values)))]


def figures(result: SoakResult) -> list[Figure]:
    injected = Counter(rnd.kind for rnd in result.rounds)
    ttfts = result.ttfts()
    out = [Figure(f"faults injected: {kind}", injected[kind], "faults") for kind in FAULT_KINDS if injected[kind]]
    out += [
        Figure("rounds", len(result.rounds), "rounds"),
        Figure("requests", len(result.records()), "requests"),
        Figure("completed", result.count(End.COMPLETED), "requests"),
        Figure("failed with a clear error", result.count(End.FAILED), "requests"),
        Figure("lost", result.count(End.LOST), "requests"),
        Figure("duplicated tokens", sum(r.verdict.duplicated_tokens for r in result.rounds), "tokens"),
        Figure("misplaced tokens", sum(r.verdict.misplaced_tokens for r in result.rounds), "tokens"),
        Figure("invariant violations", len(result.violations()), "violations"),
        Figure("TTFT p50 under faults", percentile(ttfts, 0.5), "s"),
        Figure("TTFT p99 under faults", percentile(ttfts, 0.99), "s"),
        Figure("TTFT mean under faults", statistics.fmean(ttfts) if ttfts else float("nan"), "s"),
    ]
    return out


def markdown(result: SoakResult, command: str) -> str:
    errors = Counter(msg[:120] for rnd in result.rounds for msg in rnd.verdict.errors.elements())
    lines = [
        "# Soak: random fault schedules on a cluster across network namespaces",
        "",
        f"Seed {result.seed}. Command: `{command}`",
        "",
        "| figure | value | unit |",
        "| --- | --- | --- |",
        *[f"| {f.name} | {f.value:.4g} | {f.unit} |" for f in figures(result)],
        "",
        "## Rounds",
        "",
        "| round | fault | requests | completed | failed | lost | violations | seconds |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for rnd in result.rounds:
        v = rnd.verdict
        lines.append(
            f"| {rnd.index} | {rnd.fault} | {len(rnd.records)} | {v.count(End.COMPLETED)} | {v.count(End.FAILED)} "
            f"| {v.count(End.LOST)} | {len(v.violations)} | {rnd.seconds:.0f} |"
        )
    lines += ["", "## Clear errors clients got", ""]
    lines += [f"- {n} x {msg}" for msg, n in errors.most_common()] or ["- none"]
    if result.violations():
        lines += ["", "## Violations", "", *[f"- {v}" for v in result.violations()]]
    return "\n".join(lines) + "\n"


def plot(result: SoakResult, path: str) -> None:
    """TTFT of every request by its start time, completed and failed apart, with each fault's span shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = result.records()
    if not records:
        return
    t0 = min(r.started_at for r in records)
    fig, ax = plt.subplots(figsize=(12, 4.5))
    for rnd in result.rounds:
        start, end = (t - t0 for t in rnd.fault_span)
        ax.axvspan(start, max(end, start + 0.5), color="tab:red", alpha=0.12)
        ax.text(start, 1.0, rnd.kind, rotation=90, va="top", fontsize=7, transform=ax.get_xaxis_transform())
    for end, color in ((End.COMPLETED, "tab:blue"), (End.FAILED, "tab:orange"), (End.LOST, "black")):
        points = [
            (r.started_at - t0, r.ttft_s if r.ttft_s is not None else (r.ended_at or r.started_at) - r.started_at)
            for rnd in result.rounds
            for r in rnd.records
            if rnd.verdict.ends.get(r.index) == end
        ]
        if points:
            ax.scatter(*zip(*points, strict=True), s=8, color=color, label=f"{end.value} ({len(points)})")
    ax.set_xlabel("seconds into the soak")
    ax.set_ylabel("TTFT (failed: time to the error), s")
    ax.set_title(f"soak, seed {result.seed}: requests under faults (shaded: a fault was on)")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=8.0, help="run rounds at least this long")
    parser.add_argument("--seed", type=int, default=None, help="the fault schedule's seed (default: random, printed)")
    parser.add_argument("--rate", type=float, default=1.5, help="requests per second during a round")
    parser.add_argument("--in-flight", type=int, default=9, help="at most this many requests open at once")
    parser.add_argument("--max-tokens", type=int, default=48, help="requests ask 8 to this many tokens")
    parser.add_argument("--round-s", type=float, default=20.0, help="seconds of load per round")
    parser.add_argument("--stream-end-s", type=float, default=180.0, help="how long a round waits for its streams")
    parser.add_argument("--kinds", nargs="+", default=list(FAULT_KINDS), choices=FAULT_KINDS)
    parser.add_argument("--json", default=None)
    parser.add_argument("--md", default=None, help="write the table and the rounds as markdown here")
    parser.add_argument("--png", default=None, help="draw every request's TTFT and the fault spans here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    missing = unavailable_reason() or postgres_missing()
    if missing is not None:
        print(f"soak: cannot build the cluster here: {missing}", file=sys.stderr)
        return 2
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    print(f"soak seed {seed} (rerun with --seed {seed})", flush=True)
    with tempfile.TemporaryDirectory(prefix="kvrelay-soak-") as home:
        cluster = LabCluster(Path(home)).start()
        try:
            result = run_soak(cluster, seed, args, lambda line: print(line, flush=True))
        finally:
            cluster.close()
    report(f"soak, seed {seed}", figures(result), args.json)
    if args.md:
        Path(args.md).write_text(markdown(result, " ".join(["bench/soak.py", *(argv or sys.argv[1:])])))
    if args.png:
        plot(result, args.png)
    return 0 if not result.violations() else 1


if __name__ == "__main__":
    sys.exit(main())
