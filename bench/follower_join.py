"""A follower's first token on the worker computing its prefix, with a longer prompt queued behind it.

One ``kvrelay serve`` process (one worker); per round, fresh random token ids: a leader prompt (``--prefix``
tokens plus 24 of its own), 0.5 s later a follower sharing the prefix (plus 23 tokens of its own), 0.4 s later
an unrelated ``--long``-token prompt. The follower waits for the leader's prefix (``worker.shared_prefill``) and
should get its first token one short forward after the leader's, not after a chunk of the long prompt.
Figures: medians over ``--rounds`` of each request's TTFT (client side, streamed) and of the follower's lag
behind the leader's first token; the baseline of the lag is the leader's own TTFT (what recomputing the
prefix would roughly cost). Model: Gemma 3 270M (bfloat16) unless ``--model``.

Run: ``.venv/bin/python bench/follower_join.py --json bench/results/follower_join.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvrelay.bench.report import Figure, report
from kvrelay.bench.trace.faces import kvrelay_argv
from kvrelay.launch.ports import free_port

READY = "kvrelay serve ready"


async def first_token(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], delay: float) -> float:
    """Seconds from sending ``prompt`` (after ``delay``) to its first streamed text; reads the stream to its end."""
    await asyncio.sleep(delay)
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "stream": True, "temperature": 0}
    sent = time.perf_counter()
    ttft = None
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if ttft is None and line.startswith("data:") and '"text"' in line:
                ttft = time.perf_counter() - sent
    if ttft is None:
        raise RuntimeError(f"no streamed text for a {len(prompt)}-token prompt")
    return ttft


async def rounds(url: str, args: argparse.Namespace) -> dict[str, list[float]]:
    rng = random.Random(args.seed)
    print(f"seed {args.seed}", file=sys.stderr)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(args.max_token_id // 30, args.max_token_id) for _ in range(n)]

    out: dict[str, list[float]] = {"leader": [], "follower": [], "long": [], "lag": []}
    async with httpx.AsyncClient(timeout=300) as client:
        models = (await client.get(url + "/v1/models")).json()["data"]
        model = models[0]["id"]
        await first_token(client, url, model, tokens(64), 0.0)  # warm the path
        for _ in range(args.rounds):
            prefix = tokens(args.prefix)
            leader, follower, long = await asyncio.gather(
                first_token(client, url, model, prefix + tokens(24), 0.0),
                first_token(client, url, model, prefix + tokens(23), 0.5),
                first_token(client, url, model, tokens(args.long), 0.9),
            )
            out["leader"].append(leader)
            out["follower"].append(follower)
            out["long"].append(long)
            out["lag"].append(0.5 + follower - leader)
    return out


def serve(args: argparse.Namespace, home: Path) -> tuple[subprocess.Popen[str], str]:
    port = free_port()
    argv = kvrelay_argv("serve", "--port", str(port), "--dtype", "bfloat16", "--kv-tokens", "65536", "--lanes", "16")
    argv += ["--model", args.model] if args.model else []
    env = dict(os.environ, KVRELAY_DATA_DIR=str(home), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith(READY):
            return process, f"http://127.0.0.1:{port}"
    raise RuntimeError(f"kvrelay serve exited ({process.wait()}) before it was ready")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--model", default=None, help="model source (default: Gemma 3 270M)")
    parser.add_argument("--prefix", type=int, default=960, help="tokens the leader and the follower share")
    parser.add_argument("--long", type=int, default=1588, help="tokens of the prompt queued behind the follower")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-token-id", type=int, default=30000, help="prompts draw token ids below this")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="follower-join-") as home:
        process, url = serve(args, Path(home))
        try:
            got = asyncio.run(rounds(url, args))
        finally:
            process.terminate()
            process.wait(30)
    med = {k: statistics.median(v) for k, v in got.items()}
    figures = [
        Figure("follower lag behind the leader's first token", med["lag"], "s", "leader TTFT", med["leader"]),
        Figure("follower TTFT", med["follower"], "s"),
        Figure("leader TTFT", med["leader"], "s"),
        Figure(f"{args.long}-token prompt TTFT", med["long"], "s"),
    ]
    report("a follower's first token on the worker computing its prefix", figures, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
