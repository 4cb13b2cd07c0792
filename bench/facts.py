"""Fact store speed: routing-path chain reads and batched decision writes, SQLite and PostgreSQL.

For each backend (a SQLite file in a temporary directory; a fresh schema on the
PostgreSQL server of ``--pg-url`` or ``$KVRELAY_TEST_PG_URL``, skipped if
neither is set), the store is filled with ``--keys`` chunks of lineage, an ssd
replica of every key and an object replica of every other key. Then:

- ``<db>_chain_facts_L<n>_us``: median microseconds of one ``chain_facts`` read
  (lineage and live replicas of an n-key chain, half of it unknown keys) over
  ``--reads`` random chains; baseline ``two_queries``: ``catalog_for_chain`` then
  ``replicas_for_chain`` on the same chains. ``_p99_us`` twins give the tail.
- ``<db>_chain_facts_L<n>_cpu_us``: mean CPU microseconds of this process's
  thread per read: the load-independent cost (all of it for SQLite, the client
  side only for PostgreSQL); baseline: the two-query read.
- ``<db>_cached_L<n>_us``: the same read through ``ChainFactsCache`` when every
  key is cached; baseline: the uncached read.
- ``<db>_decision_writes_per_s``: decision + offer-outcome + outcome records
  (``--candidates`` candidates per decision) written per second by the batched
  writer, from first submit to flush; baseline ``one_per_txn``: the same writer
  with batches of one record.
- ``<db>_submit_p99_us``: the 99th percentile of ``submit`` itself during that
  run; baseline: its median.

Run: ``.venv/bin/python bench/facts.py --json bench-facts.json`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from kvrelay.bench.report import Figure, report  # noqa: E402
from kvrelay.core.router.events import Record  # noqa: E402
from kvrelay.facts.cache import ChainFactsCache  # noqa: E402
from kvrelay.facts.store import FactStore, WriterSettings  # noqa: E402
from kvrelay.testing.databases import pg_base_url, postgres_schema_url  # noqa: E402

FP = b"bench-model"


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def fill(url: str, keys: int) -> None:
    settings = WriterSettings(buffer_size=keys * 3 + 10, batch_size=2000)
    with FactStore(url, settings=settings) as store:
        for start in range(0, keys, 1000):
            block = range(start, min(keys, start + 1000))
            store.record_lineage([(key(i), key(i - 1) if i else None, FP, i + 1) for i in block])
        for i in range(keys):
            store.record_replicas_stored(key(i), "ssd", f"w{i % 8}", 1 << 21, now=1.0)
            if i % 2 == 0:
                store.record_replicas_stored(key(i), "object", "bucket/kv", 1 << 21, now=1.0)
        if not store.flush(600):
            raise RuntimeError("filling the store did not finish in 600 s")


def chains(keys: int, length: int, count: int, rng: random.Random) -> list[list[bytes]]:
    """Chains whose first half is stored and second half unknown, like a partly cached prompt."""
    out = []
    for _ in range(count):
        start = rng.randrange(0, keys - length)
        known = [key(start + i) for i in range(length - length // 2)]
        out.append(known + [key(keys + rng.randrange(1 << 40)) for _ in range(length // 2)])
    return out


def timed_us(fn: Callable[[list[bytes]], Any], inputs: Sequence[list[bytes]]) -> list[float]:
    """Wall-clock microseconds of each call."""
    samples = []
    for chain in inputs:
        start = time.perf_counter()
        fn(chain)
        samples.append((time.perf_counter() - start) * 1e6)
    return samples


def cpu_us(fn: Callable[[list[bytes]], Any], inputs: Sequence[list[bytes]]) -> float:
    """Mean CPU microseconds of this thread per call (SQLite runs in this thread; a PostgreSQL server does not)."""
    start = time.thread_time()
    for chain in inputs:
        fn(chain)
    return (time.thread_time() - start) * 1e6 / len(inputs)


def p99(samples: list[float]) -> float:
    return sorted(samples)[int(0.99 * (len(samples) - 1))]


def read_figures(db: str, url: str, keys: int, reads: int, rng: random.Random) -> list[Figure]:
    figures = []
    with FactStore(url) as store:
        reader = store.reader
        for length in (8, 32, 128):
            inputs = chains(keys, length, reads, rng)
            timed_us(reader.chain_facts, inputs[:50])
            one = timed_us(reader.chain_facts, inputs)
            two = timed_us(lambda c: (reader.catalog_for_chain(c), reader.replicas_for_chain(c)), inputs)
            cache = ChainFactsCache(reader, max_keys=1_000_000, ttl_s=3600.0)
            for chain in inputs:
                cache.chain_facts(chain)
            cached = timed_us(cache.chain_facts, inputs)
            base = statistics.median(two)
            one_cpu, two_cpu = (
                cpu_us(reader.chain_facts, inputs),
                cpu_us(lambda c: (reader.catalog_for_chain(c), reader.replicas_for_chain(c)), inputs),
            )
            figures += [
                Figure(f"{db}_chain_facts_L{length}_cpu_us", one_cpu, "us", "two_queries_cpu", two_cpu),
                Figure(f"{db}_chain_facts_L{length}_us", statistics.median(one), "us", "two_queries", base),
                Figure(f"{db}_chain_facts_L{length}_p99_us", p99(one), "us", "two_queries_p99", p99(two)),
                Figure(
                    f"{db}_cached_L{length}_us", statistics.median(cached), "us", "uncached", statistics.median(one)
                ),
            ]
    return figures


def decision_records(n: int, candidates: int) -> Iterator[Record]:
    for i in range(n):
        cands = [
            {
                "worker_id": f"w{c}",
                "route": [["gpu", 3], ["ssd", 2]],
                "cached_tokens": 320,
                "predicted_ttft_s": 0.05 + c * 1e-3,
                "terms": {
                    "queue_s": 0.01,
                    "restore_s": {"ssd": 0.004},
                    "prefill_s": 0.01 + c * 1e-3,
                    "decode_s": 0.025,
                },
            }
            for c in range(candidates)
        ]
        rid = f"req-{i}"
        yield Record(
            "decision",
            rid,
            1,
            float(i),
            {
                "policy": "kvrelay",
                "model": "m",
                "chosen": cands[0],
                "candidates": cands,
                "excluded": {"w99": "no_capacity"},
            },
        )
        yield Record("offer_outcome", rid, 1, float(i), {"worker_id": "w0", "outcome": "accepted", "reason": None})
        yield Record(
            "outcome",
            rid,
            1,
            float(i) + 1,
            {
                "finish_reason": "stop",
                "ttft_s": 0.06,
                "inter_token_s": [0.025] * 16,
                "cached_tokens": {"gpu": 192, "ssd": 128},
                "recomputed_tokens": 40,
                "generated_tokens": 16,
                "bytes_by_tier": {"ssd": 1 << 22},
                "attempts": 1,
                "error": None,
            },
        )


def write_rate(url: str, records: list[Record], batch_size: int) -> tuple[float, list[float]]:
    """Records per second from first submit to flush, and each submit's latency in microseconds."""
    settings = WriterSettings(buffer_size=len(records) + 1, batch_size=batch_size)
    with FactStore(url, settings=settings) as store:
        submit_us = []
        start = time.perf_counter()
        for record in records:
            t0 = time.perf_counter()
            store.submit(record)
            submit_us.append((time.perf_counter() - t0) * 1e6)
        if not store.flush(600):
            raise RuntimeError("writes did not finish in 600 s")
        elapsed = time.perf_counter() - start
        stats = store.stats()
        if stats.written != len(records):
            raise RuntimeError(f"only {stats.written} of {len(records)} records were written: {stats}")
    return len(records) / elapsed, submit_us


def write_figures(db: str, url: str, decisions: int, candidates: int) -> list[Figure]:
    batched, submit_us = write_rate(url, list(decision_records(decisions, candidates)), 500)
    single, _ = write_rate(
        url,
        [
            r
            for r in decision_records(decisions, candidates)
            for r in [Record(r.kind, "one-" + r.request_id, r.attempt, r.now, r.data)]
        ],
        1,
    )
    return [
        Figure(f"{db}_decision_writes_per_s", batched, "records/s", "one_per_txn", single),
        Figure(f"{db}_submit_p99_us", p99(submit_us), "us", "submit_median", statistics.median(submit_us)),
    ]


@contextmanager
def backend_url(db: str, pg_url: str | None) -> Iterator[str]:
    if db == "sqlite":
        with tempfile.TemporaryDirectory(prefix="kvrelay-bench-facts-") as tmp:
            yield f"sqlite:///{Path(tmp) / 'facts.sqlite3'}"
    else:
        assert pg_url is not None
        with postgres_schema_url(pg_url) as url:
            yield url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=100_000, help="chunks in the store (default 100000)")
    parser.add_argument("--reads", type=int, default=2000, help="chain reads per figure (default 2000)")
    parser.add_argument("--decisions", type=int, default=3000, help="requests written per write figure (default 3000)")
    parser.add_argument("--candidates", type=int, default=8, help="candidates per decision record (default 8)")
    parser.add_argument("--pg-url", default=pg_base_url(), help="PostgreSQL URL (default $KVRELAY_TEST_PG_URL)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    args = parser.parse_args()
    if args.quick:
        args.keys, args.reads, args.decisions = 2000, 50, 100
    print(
        f"seed {args.seed}; keys {args.keys}; reads {args.reads}; "
        f"decisions {args.decisions} x {args.candidates} candidates"
    )
    backends = ["sqlite"] + (["postgresql"] if args.pg_url else [])
    if not args.pg_url:
        print(
            "PostgreSQL skipped: pass --pg-url or set KVRELAY_TEST_PG_URL (bash scripts/start_postgres.sh prints one)"
        )
    figures: list[Figure] = []
    for db in backends:
        with ExitStack() as stack:
            url = stack.enter_context(backend_url(db, args.pg_url))
            start = time.perf_counter()
            fill(url, args.keys)
            print(f"{db}: filled {args.keys} keys in {time.perf_counter() - start:.1f} s")
            figures += read_figures(db, url, args.keys, args.reads, random.Random(args.seed))
            figures += write_figures(db, url, args.decisions, args.candidates)
    report("fact store", figures, args.json)


if __name__ == "__main__":
    main()
