"""Steady closed-loop streams through kvrelay's router and SGLang Model Gateway in front of the same vLLM engine.

``--engines`` vLLM servers (CPU build from ``.venv-vllm``) of the vLLM tests' tiny random Llama (float32,
``--blocks`` KV blocks of 64 tokens each) are started once. Each setup is a router in front of them: kvrelay's
router with the same engines in its own process (``kvrelay router --vllm-in-process``, vLLM's ``AsyncLLM`` with the
servers' engine arguments, started afresh for each measurement while the servers idle), smg 1.13.0 ``--policy
cache_aware`` in front of the servers (``make routers``; left out, and said, when it is not installed), and, when
named, ``kvrelay_over_http``: kvrelay's router driving the servers from its own process (``--vllm-engine``, as
``kvrelay cluster --engine vllm`` deploys it). For every count of ``--streams`` and every round, each setup in
alternating order is started, warmed for ``--warm-s`` seconds, then measured for ``--seconds``: that many streams
each send a request as soon as the one before ended (``--prompt-words`` random words, hardly a prefix shared,
``--max-tokens`` new tokens, the light client of ``kvrelay.bench.light_streams``). Figures, pooled over rounds:
TTFT p50 / p90 / p99, completed requests a second, and the times kvrelay's router held a request in its queue.

Where ``bench/real_routers.py`` replays a trace at its own arrival times, this keeps the engine's lanes and
blocks near full, which is where a router's accounting of them decides whether requests wait: a request that
ends must give its pages back at once (docs/performance.md, "Pages of requests that ended").

Run (about 5 minutes): ``.venv/bin/python bench/steady_streams.py --json bench/results/steady_streams.json``
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvrelay.bench.light_streams import light_session
from kvrelay.bench.report import Figure, report
from kvrelay.bench.scenarios.stats import quantile
from kvrelay.bench.streams import StreamRecord
from kvrelay.bench.trace.client import wait_ready
from kvrelay.bench.trace.faces import Face, start_peer
from kvrelay.bench.trace.peers import Peer, find_peer
from kvrelay.bench.trace.vllm_engines import kvrelay_in_process, kvrelay_over_vllm, peer_face, shared_engines
from kvrelay.testing.vllm import make_vllm_tiny_model

SETUPS = ("kvrelay", "smg", "kvrelay_over_http")
WORDS = (
    "the of and to in is that it was for on are as with his they at be this from have or by one had not but what "
    "all were when we there can an your which their said if do will each about how up out them then she many some "
    "so these would other into has more her two like him see time could no make than first been its who now people"
).split()
QUEUE_WAITS = "kvrelay_router_queue_waits_total"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", default="4,16", help="comma-separated counts of concurrent streams")
    p.add_argument("--rounds", type=int, default=2, help="measurements per setup and count, alternating")
    p.add_argument("--seconds", type=float, default=12.0, help="measured seconds per setup, count and round")
    p.add_argument("--warm-s", type=float, default=3.0, help="unmeasured seconds of the same load first")
    p.add_argument("--prompt-words", type=int, default=300, help="random words a prompt (smg routes by text)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--engines", type=int, default=1, help="vLLM servers behind every router")
    p.add_argument("--blocks", type=int, default=256, help="KV blocks of 64 tokens per server")
    p.add_argument("--setups", default=",".join(SETUPS[:2]), help=f"comma-separated subset of {', '.join(SETUPS)}")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts' words (each setup draws the same)")
    p.add_argument("--json", default=None, help="write the figures here")
    return p.parse_args(argv)


@dataclass
class Samples:
    """One setup's measurements at one count of streams, pooled over rounds."""

    ttft_s: list[float] = field(default_factory=list)
    completed: int = 0
    errors: int = 0
    seconds: float = 0.0
    queue_waits: float = 0.0


async def closed_loop(
    url: str, model: str, streams: int, seconds: float, rng: random.Random, args: argparse.Namespace
) -> list[StreamRecord]:
    """``streams`` streams, each sending its next request as soon as its last one ended, for ``seconds``; the
    prompts' words come from ``rng``."""
    records: list[StreamRecord] = []
    deadline = time.monotonic() + seconds

    async with light_session(url, model, 60.0) as send:

        async def stream() -> None:
            while time.monotonic() < deadline:
                prompt = " ".join(rng.choice(WORDS) for _ in range(args.prompt_words))
                record = StreamRecord(len(records), args.prompt_words)
                records.append(record)
                await send(prompt, args.max_tokens, record, None)

        await asyncio.gather(*(stream() for _ in range(streams)))
    return records


def queue_waits(url: str) -> float:
    """kvrelay's router's count of requests held in its queue so far (0 for a router without the metric)."""
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(QUEUE_WAITS + " "):
            return float(line.split()[1])
    return 0.0


async def measure(face: Face, model: str, streams: int, args: argparse.Namespace, into: Samples) -> None:
    """Warm the setup up, then add one measured window to ``into``. One generator draws the prompts of both
    windows, so the measured one never repeats a warm-up prompt (whose KV the engine would still hold), and
    every setup draws the same sequence."""
    rng = random.Random(args.seed)
    await wait_ready(face.url, model, face)
    await closed_loop(face.url, model, streams, args.warm_s, rng, args)
    waits = queue_waits(face.url)
    started = time.monotonic()
    records = await closed_loop(face.url, model, streams, args.seconds, rng, args)
    into.seconds += time.monotonic() - started
    into.queue_waits += queue_waits(face.url) - waits
    into.completed += sum(r.completed for r in records)
    into.errors += sum(r.error is not None for r in records)
    into.ttft_s += [t for r in records if r.completed and (t := r.ttft_s) is not None]


def figures(samples: dict[tuple[str, int], Samples], setups: Sequence[str], counts: Sequence[int]) -> list[Figure]:
    """kvrelay's figures per count of streams, each against smg's where smg ran."""
    out: list[Figure] = []
    for streams in counts:
        ours = samples[("kvrelay", streams)]
        theirs = samples.get(("smg", streams)) if "smg" in setups else None
        theirs = theirs if theirs is not None and theirs.ttft_s else None
        for q in (0.5, 0.9, 0.99):
            value = quantile(ours.ttft_s, q) or 0.0
            base = quantile(theirs.ttft_s, q) if theirs else None
            out.append(
                Figure(f"streams_{streams}_ttft_p{round(q * 100)}_s", value, "s", "smg" if theirs else None, base)
            )
        rate = ours.completed / max(ours.seconds, 1e-9)
        their_rate = theirs.completed / max(theirs.seconds, 1e-9) if theirs else None
        out.append(Figure(f"streams_{streams}_requests_per_s", rate, "req/s", "smg" if theirs else None, their_rate))
        out.append(Figure(f"streams_{streams}_router_queue_waits", ours.queue_waits, "requests"))
        out.append(Figure(f"streams_{streams}_errors", float(ours.errors), "requests"))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    counts = [int(c) for c in args.streams.split(",") if c]
    setups = [s for s in args.setups.split(",") if s]
    if "kvrelay" not in setups or not set(setups) <= set(SETUPS):
        raise SystemExit(f"--setups must include kvrelay and name only {', '.join(SETUPS)}; got {args.setups}")
    smg = find_peer(Peer.SMG) if "smg" in setups else None
    if "smg" in setups and smg is None:
        setups.remove("smg")
        print("smg is not installed (`make routers`): the smg setup is left out.", flush=True)
    samples = {(s, c): Samples() for s in setups for c in counts}
    with tempfile.TemporaryDirectory(prefix="kvrelay-steady-") as tmp:
        work = Path(tmp)
        model_dir = make_vllm_tiny_model(work / "tiny-llama")
        with shared_engines(model_dir, args.engines, args.blocks, work / "vllm-logs") as engines:
            for round_ in range(args.rounds):
                for streams in counts:
                    for name in setups if round_ % 2 == 0 else setups[::-1]:
                        home = work / f"{name}-{streams}-{round_}"
                        if name == "kvrelay":
                            face = kvrelay_in_process(name, "kvrelay", engines, model_dir, home)
                        elif name == "kvrelay_over_http":
                            face = kvrelay_over_vllm(name, "kvrelay", engines, model_dir, home, attached=True)
                        else:
                            face, urls = peer_face(name, engines, home)
                            start_peer(face, Peer.SMG, str(smg), "cache_aware", urls)
                        try:
                            asyncio.run(measure(face, model_dir.name, streams, args, samples[(name, streams)]))
                        finally:
                            face.stop()
                        s = samples[(name, streams)]
                        print(f"round {round_ + 1}, {streams} streams, {name}: {s.completed} done so far", flush=True)
    title = (
        f"Steady streams on {args.engines} tiny-Llama vLLM engine(s) of {args.blocks} blocks: prompts of "
        f"{args.prompt_words} random words, {args.max_tokens} new tokens, {args.seconds:g} s x {args.rounds} rounds"
    )
    report(title, figures(samples, setups, counts), args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
