"""For Gemma 3 270M: the prefix length above which restoring it from a tier beats recomputing it.

For each prefix length P (a multiple of 64), the prompt is P + 1 tokens. Cold:
the runtime prefills all P + 1 tokens and samples the first token. Warm from a
tier: the P tokens' chunks are read from that tier (ram as the worker keeps it,
header-checked; ssd with the payload digest checked, file in the page cache;
S3 on a local moto server when ``--s3`` is given), copied into pages by the
same code a worker uses, then the runtime prefills the last token. The
break-even is the smallest measured P where warm is faster than cold (the
fastest of ``--repeats`` runs each). Measured, not assumed.

    .venv/bin/python bench/break_even.py [--dtype bfloat16] [--s3] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvrelay.bench.report import Figure, report  # noqa: E402
from kvrelay.models.kernels.kv_pages import KVPages  # noqa: E402
from kvrelay.models.loading.loader import load_artifacts  # noqa: E402
from kvrelay.models.registry import build_model  # noqa: E402
from kvrelay.protocol.chunk_keys import chunk_chain  # noqa: E402
from kvrelay.store.chunk_format import encode_chunk  # noqa: E402
from kvrelay.store.files import SsdTier  # noqa: E402
from kvrelay.store.ram import RamTier  # noqa: E402
from kvrelay.store.tier import ChunkTier  # noqa: E402
from kvrelay.worker.chunk_io import gather_chunk, scatter_chunk  # noqa: E402
from kvrelay.worker.runtime.iteration import PolicyConfig  # noqa: E402
from kvrelay.worker.runtime.jobs import Job  # noqa: E402
from kvrelay.worker.runtime.loop import PagedRuntime  # noqa: E402

LENGTHS = (64, 128, 256, 512, 1024, 2048)


def fastest(repeats: int, run: Callable[[], float]) -> float:
    return min(run() for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--s3", action="store_true", help="also restore from S3 on a local moto_server")
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    artifacts = load_artifacts(None, dtype)
    model = build_model(artifacts.config, artifacts.weights, dtype)
    lengths = [n for n in LENGTHS if n <= args.max_length]
    pages_per_seq = -(-(lengths[-1] + 2) // 16)
    kv = KVPages.allocate(artifacts.config, 2 * pages_per_seq, 16, dtype)
    runtime = PagedRuntime(model, kv, PolicyConfig(num_lanes=1, token_budget=4096))
    fp = artifacts.fingerprint
    prompt = tuple(int(t) for t in torch.randint(10, 20000, (lengths[-1] + 1,)))
    table = tuple(range(pages_per_seq))
    scratch = tuple(range(pages_per_seq, 2 * pages_per_seq))

    def cold(p: int) -> float:
        start = time.perf_counter()
        runtime.generate(Job(prompt[: p + 1], table, 0, 1), timeout=600)
        return time.perf_counter() - start

    runtime.generate(Job(prompt[: lengths[-1] + 1], table, 0, 1), timeout=600)  # warm-up; fills table's pages
    keys = chunk_chain(fp, prompt, 64, lengths[-1] // 64)
    blobs = [encode_chunk(k, fp, gather_chunk(kv, table[i * 4 : (i + 1) * 4])) for i, k in enumerate(keys)]
    tmp = tempfile.TemporaryDirectory()
    tiers: dict[str, ChunkTier] = {
        "ram": RamTier(1 << 32, verify_payload=False),
        "ssd": SsdTier(Path(tmp.name) / "ssd", 1 << 34, fsync=False),
    }
    stack = contextlib.ExitStack()
    if args.s3:
        from kvrelay.store.s3 import S3Tier
        from kvrelay.testing.moto import running_moto_server

        os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        endpoint = stack.enter_context(running_moto_server())
        s3 = S3Tier(S3Tier.make_client(endpoint), "kvrelay-bench", "chunks/")
        s3.create_bucket()
        tiers["object"] = s3
    for tier in tiers.values():
        for blob in blobs:
            tier.put(blob)

    def warm(tier: ChunkTier, p: int) -> float:
        start = time.perf_counter()
        for i, key in enumerate(keys[: p // 64]):
            view = tier.get(key, fp)
            assert view is not None, f"chunk {i} missing from {tier.name}"
            scatter_chunk(kv, scratch[i * 4 : (i + 1) * 4], view.tensor())
        runtime.generate(Job(prompt[p : p + 1], scratch, p, 1), timeout=600)
        return time.perf_counter() - start

    figures: list[Figure] = []
    rows = []
    for p in lengths:
        c = fastest(args.repeats, lambda: cold(p))
        warm_s = {name: fastest(args.repeats, lambda t=t: warm(t, p)) for name, t in tiers.items()}
        rows.append((p, c, warm_s))
        for name, w in warm_s.items():
            figures.append(Figure(f"ttft_{name}_prefix_{p}", w, "s", "recompute", c))
    print(f"{'prefix':>7} {'recompute s':>12} " + " ".join(f"{n + ' s':>10}" for n in tiers))
    for p, c, warm_s in rows:
        print(f"{p:>7} {c:>12.4f} " + " ".join(f"{warm_s[n]:>10.4f}" for n in tiers))
    for name in tiers:
        wins = [p for p, c, warm_s in rows if warm_s[name] < c]
        figures.append(
            Figure(
                f"break_even_{name}_tokens",
                min(wins) if wins else float("inf"),
                "tokens",
                "measured lengths",
                lengths[-1],
            )
        )
    runtime.close()
    stack.close()
    tmp.cleanup()
    report(f"restore vs recompute, Gemma 3 270M {args.dtype}", figures, args.json)


if __name__ == "__main__":
    main()
