"""Admission decision time (validation to reservation) on a pool of 100,000 pages.

The pool starts full of cached chunks (so most admissions plan evictions) with
a tenth of them durable; each offer shares a random resident prefix, reserves
its demand atomically, then ends at once (untimed) so the pool stays full.

    .venv/bin/python bench/admission.py [--offers N] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import random
import time

from kvrelay.bench.report import Figure, report  # noqa: E402
from kvrelay.protocol.chunk_keys import prompt_chain  # noqa: E402
from kvrelay.protocol.messages import Assignment, Offer, RouteSegment  # noqa: E402
from kvrelay.worker.admission import WorkerIdentity, admit  # noqa: E402
from kvrelay.worker.page_pool import PagePool  # noqa: E402

PAGES = 100_000
ME = WorkerIdentity("w0", 1, "m", b"fp", context_limit=1 << 20)


def fill(pool: PagePool, rng: random.Random, prompts: list[tuple[int, ...]]) -> None:
    """Write every prompt's chunks into the pool and leave them cached."""
    for i, prompt in enumerate(prompts):
        chain = prompt_chain(ME.fingerprint, prompt, 64)
        result = admit(
            pool,
            ME,
            Offer(
                assignment=Assignment(f"fill{i}", 1),
                worker_id="w0",
                epoch=1,
                model="m",
                prompt=prompt,
                max_new_tokens=1,
            ),
        )
        if not result.accepted:
            continue
        fresh = chain[len(result.prefix) :]
        pages = pool.take(result.reservation, len(fresh) * 4)
        for j, key in enumerate(fresh):
            pool.register(key, pages[j * 4 : (j + 1) * 4])
            if rng.random() < 0.1:
                pool.mark_durable(key)
        pool.release(result.reservation)
        pool.unref([p for ch in result.prefix for p in ch] + pages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--offers", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    docs = [tuple(rng.randrange(1, 50_000) for _ in range(64 * 40 + 1)) for _ in range(1400)]
    prompts = [
        doc[: 64 * rng.randrange(4, 40) + 1] + tuple(rng.randrange(1, 50_000) for _ in range(100))
        for doc in docs
        for _ in range(2)
    ]
    pool = PagePool(PAGES)
    fill(pool, rng, prompts)
    # The prepared prompts are the benchmark's input: keep the cyclic GC from re-scanning them.
    gc.collect()
    gc.freeze()
    lat: list[float] = []
    accepted = 0
    for i in range(args.offers):
        prompt = prompts[rng.randrange(len(prompts))]
        resident = len(pool.resident_prefix(prompt_chain(ME.fingerprint, prompt, 64)))
        offer = Offer(
            assignment=Assignment(f"r{i}", 1),
            worker_id="w0",
            epoch=1,
            model="m",
            prompt=prompt,
            max_new_tokens=256,
            route=(RouteSegment("gpu", resident),) if resident else (),
        )
        t0 = time.perf_counter()
        result = admit(pool, ME, offer)
        lat.append(time.perf_counter() - t0)
        if result.accepted:
            accepted += 1
            pool.release(result.reservation)
            pool.unref([p for ch in result.prefix for p in ch])
    lat.sort()
    figures = [
        Figure("admission_p50", lat[len(lat) // 2] * 1e3, "ms"),
        Figure("admission_p99", lat[int(0.99 * (len(lat) - 1))] * 1e3, "ms", "goal", 1.0),
        Figure("accepted_share", accepted / args.offers, "1"),
        Figure("pool_pages", PAGES, "pages"),
        Figure("evictions", len(pool.evictions), "chunks"),
    ]
    report(f"admission ({args.offers} offers, pool of {PAGES} pages)", figures, args.json)


if __name__ == "__main__":
    main()
