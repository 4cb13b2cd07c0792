"""Routing decisions per second and decision latency of the pure router.

64 workers, an index of 1,000,000 resident chunks (gpu, ram and ssd replicas of
5,000 shared documents of 250 chunks), requests that each reuse a random prefix
of one document plus a fresh suffix. Each timed step is one ``RequestArrived``
through ``router.step``: chain lookup, candidate planning over every worker and
tier boundary, policy choice, the offer and the decision record. The request
is then completed (untimed) so load stays steady. A third run attaches the
fact store (SQLite) and the router's replica map: the durable replicas are
joined into the index as a running router joins them (every object replica at
start, a worker's own when its epoch begins; untimed), and each timed decision
also hands its records to the store (encoded on the routing thread, written by
the store's writer process); the untimed completion steps' records go there
too. After the timed loop the store is drained and its counters reported:
every record submitted must be written, none may overflow the store's default
buffer. The records the router produced per second of the timed loop (wall
clock, completion steps included: the sustained load on the writer) are
compared with what the writer writes per second of its busy time (time spent
writing batches, counted by the writer, during the loop and the drain after
it); its busy share is busy time over the loop's wall time (under 1: it keeps
up). The sink's time per record is the routing thread's share.

    .venv/bin/python bench/router_decisions.py [--requests N] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field

from kvrelay.bench.report import Figure, report  # noqa: E402
from kvrelay.core.planning.index import ResidencyIndex  # noqa: E402
from kvrelay.core.router.events import (  # noqa: E402
    MessageReceived,
    Record,
    ReplicasKnown,
    Request,
    RequestArrived,
    SendOffer,
)
from kvrelay.core.router.machine import RouterConfig, new_router, step  # noqa: E402
from kvrelay.facts.replica_map import ReplicaMap  # noqa: E402
from kvrelay.facts.sink import record_sink  # noqa: E402
from kvrelay.facts.store import FactStore, FactStoreStats  # noqa: E402
from kvrelay.protocol.messages import Heartbeat, OfferResult, Residency, Result  # noqa: E402

WORKERS = 64
DOCS = 5000
DOC_CHUNKS = 250


def heartbeat(i: int, seq: int = 1) -> Heartbeat:
    return Heartbeat(
        worker_id=f"w{i:02d}",
        epoch=1,
        seq=seq,
        models=("m",),
        pages_total=25_000,
        pages_free=20_000,
        pages_evictable=5_000,
        queue_delay_s=0.01 * (i % 7),
        prefill_s_per_token=1e-4,
        decode_s_per_token=0.025,
        restore_bytes_per_s={"ram": 2e10, "ssd": 5e9, "peer": 1e10, "object": 2e9},
        kv_bytes_per_token=131072,
        context_limit=131072,
    )


def doc_keys(d: int) -> list[bytes]:
    return [d.to_bytes(8, "little") + c.to_bytes(8, "little") for c in range(DOC_CHUNKS)]


def build(seed: int, policy: str, sink: Callable[[Record], None] | None = None) -> tuple[object, random.Random]:
    rng = random.Random(seed)
    state = new_router(RouterConfig(max_index_keys=1_100_000, offer_timeout_s=1e9), policy, seed)
    for i in range(WORKERS):
        state, _ = step(state, MessageReceived(0.0, heartbeat(i)))
    seqs = [1] * WORKERS
    for d in range(DOCS):
        keys = tuple(doc_keys(d))
        for tier in ("gpu", "ram", "ssd"):
            w = rng.randrange(WORKERS)
            seqs[w] += 1
            msg = Residency(
                worker_id=f"w{w:02d}",
                epoch=1,
                seq=seqs[w],
                tier=tier,
                model="m",
                stored=keys[: rng.randrange(DOC_CHUNKS // 4, DOC_CHUNKS + 1)],
            )
            state, fx = step(state, MessageReceived(0.0, msg))
            if sink is not None:  # ssd residency becomes replica facts, as in a running router
                for effect in fx:
                    if isinstance(effect, Record):
                        sink(effect)
    return state, rng


def bytes_per_entry(n: int = 200_000) -> float:
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    ix = ResidencyIndex(max_keys=n)
    for d in range(n // DOC_CHUNKS):
        ix.store(f"w{d % WORKERS}", "gpu", doc_keys(d))
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (after - before) / len(ix)


@dataclass
class Loop:
    """What one run's timed loop took: per-decision latencies, wall time, and with a store its stats before the
    loop (after the start-up burst was written), the records submitted and the time the sink calls took."""

    latencies: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    index_keys: int = 0
    before: FactStoreStats | None = None
    records: int = 0
    sink_s: float = 0.0


def run(requests: int, seed: int, policy: str, facts: FactStore | None = None) -> Loop:
    """Time ``step(RequestArrived)`` per request; with ``facts``, also the record sink."""
    replica_map = ReplicaMap.load(facts.engine) if facts is not None else None
    sink = record_sink(facts, replica_map) if facts is not None else None
    loop = Loop()
    state, rng = build(seed, policy, sink)
    if facts is not None and replica_map is not None:
        facts.flush(600)  # the start-up burst of replica facts is written before the timed decisions
        state, _ = step(state, ReplicasKnown(0.0, replica_map.of_tier("object")))
        for i in range(WORKERS):
            state, _ = step(state, ReplicasKnown(0.0, replica_map.held_by(f"w{i:02d}")))
        loop.before = facts.stats()
    lat = loop.latencies
    prompts = []
    # Requests with the same prefix length get equal prompts: one shared tuple each (the router reads a
    # prompt's length and passes the tuple on; 20,000 private copies of up to 16k token ids would hold some
    # 7 GB that no router holds, its in-flight requests being few).
    texts: dict[int, tuple[int, ...]] = {}
    for r in range(requests):
        d = rng.randrange(DOCS)
        n = rng.randrange(8, DOC_CHUNKS)
        chain = tuple(doc_keys(d)[:n])
        prompt = texts.get(n) or texts.setdefault(n, tuple(range(n * 64 + 200)))
        prompts.append(Request(f"r{r}", "m", prompt, 64, chain=chain))
    # The prepared requests are the benchmark's input, not router state: keep the cyclic GC
    # from re-scanning them during timed steps.
    gc.collect()
    gc.freeze()
    perf = time.perf_counter
    started = perf()
    for r, req in enumerate(prompts):
        t0 = perf()
        state, fx = step(state, RequestArrived(float(r), req))
        if sink is not None:
            t1 = perf()
            for effect in fx:
                if isinstance(effect, Record):
                    sink(effect)
                    loop.records += 1
            loop.sink_s += perf() - t1
        lat.append(perf() - t0)
        offer = next(e for e in fx if isinstance(e, SendOffer)).offer
        state, fx = step(
            state,
            MessageReceived(
                float(r), OfferResult(assignment=offer.assignment, worker_id=offer.worker_id, epoch=1, accepted=True)
            ),
        )
        state, more = step(
            state,
            MessageReceived(
                float(r),
                Result(assignment=offer.assignment, worker_id=offer.worker_id, tokens=(1,), finish_reason="stop"),
            ),
        )
        if sink is not None:
            t1 = perf()
            for effect in (*fx, *more):
                if isinstance(effect, Record):
                    sink(effect)
                    loop.records += 1
            loop.sink_s += perf() - t1
        w = int(offer.worker_id[1:])
        state, _ = step(state, MessageReceived(float(r), heartbeat(w, seq=r + 2)))
    loop.wall_s = perf() - started
    gc.unfreeze()
    loop.index_keys = len(state.index)
    return loop


def with_fact_store(requests: int, seed: int, without: float) -> list[Figure]:
    """The kvrelay run with the fact store attached (a SQLite file in a temporary directory)."""
    with tempfile.TemporaryDirectory() as tmp, FactStore(f"sqlite:///{tmp}/facts.sqlite3") as facts:
        loop = run(requests, seed, "kvrelay", facts)
        behind = facts.stats().pending
        facts.flush(600)
        stats = facts.stats()
    assert loop.before is not None
    written = stats.written - loop.before.written
    busy_s = (stats.writer_busy_us - loop.before.writer_busy_us) / 1e6
    lat = loop.latencies
    lat_sorted = sorted(lat)
    produced = loop.records / loop.wall_s
    return [
        Figure("decisions_per_s_with_fact_store", len(lat) / sum(lat), "1/s", "goal", 5000),
        Figure("decisions_per_s_with_fact_store_vs_without", len(lat) / sum(lat), "1/s", "kvrelay", without),
        Figure("decision_p99_with_fact_store", lat_sorted[int(0.99 * (len(lat_sorted) - 1))] * 1e3, "ms"),
        Figure("fact_records_per_s_produced", produced, "1/s"),
        Figure("fact_writer_records_per_busy_s", written / busy_s, "1/s", "produced", produced),
        Figure("fact_writer_busy_share", busy_s / loop.wall_s, "1", "goal", 1.0),
        Figure("fact_sink_per_record", loop.sink_s / loop.records * 1e6, "us"),
        Figure("fact_store_overflow", stats.overflow, "records", "goal", 0),
        Figure("fact_store_pending_after_timed_loop", behind, "records"),
        Figure("fact_store_written", stats.written, "records", "submitted", stats.submitted),
        Figure("fact_store_dropped_or_rejected", stats.dropped + stats.rejected, "records", "goal", 0),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    figures: list[Figure] = []
    for policy in ("kvrelay", "round_robin"):
        loop = run(args.requests, args.seed, policy)
        lat, index_size = loop.latencies, loop.index_keys
        lat_sorted = sorted(lat)
        rate = len(lat) / sum(lat)
        p50 = statistics.median(lat_sorted) * 1e3
        p99 = lat_sorted[int(0.99 * (len(lat_sorted) - 1))] * 1e3
        if policy == "kvrelay":
            figures += [
                Figure("decisions_per_s", rate, "1/s", "goal", 5000),
                Figure("decision_p50", p50, "ms"),
                Figure("decision_p99", p99, "ms", "goal", 2.0),
                Figure("index_keys", index_size, "keys"),
                Figure("workers", WORKERS, "workers"),
            ]
        else:
            figures.append(Figure("decisions_per_s_round_robin", rate, "1/s", "kvrelay", figures[0].value))
    figures += with_fact_store(args.requests, args.seed, figures[0].value)
    figures.append(Figure("index_bytes_per_entry", bytes_per_entry(), "B"))
    report(f"router decisions ({args.requests} requests, 1 core, seed {args.seed})", figures, args.json)


if __name__ == "__main__":
    main()
