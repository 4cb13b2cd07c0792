"""The scenario cases, run in order against one ``BenchCluster`` (started with workers w1 and w2).

Each case sends ``requests`` streaming completions through the OpenAI API and
is summarized by ``scenario_stats.summarize_case`` over its measured window;
evictions and peak pages count from the start of the case's setup. In order:

1. ``cold``: each request its own new prefix (nothing cached);
2. ``resident``: after one warm-up request, the shared prefix with new suffixes;
3. ``partial``: the first half of the shared prefix, then new ids;
4. ``ssd``: after a flood of new prompts evicts the cold prefixes from pages and
   the ram tier, the cold prefixes with new suffixes (their chunks are on the
   ssd tier of the worker that computed them);
5. ``cancellation``: the shared prefix with the resident case's suffixes, all
   at once; every third stream is closed by its client after a quarter of its
   budget; the others must complete with the resident case's text, and the
   workers must come back to no referenced or reserved page;
6. ``restart``: the same prompts at once; when half the streams have tokens,
   the worker running most of them is killed (SIGKILL) and started again;
   every stream must still complete (by continuation), none lost;
7. ``object``: a fresh worker w3 (empty chunk directory) starts and w1 and w2
   stop; the cold prefixes again, now only in the object tier. It runs last,
   so the cluster needs no more restarts.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvrelay.bench.cluster import BenchCluster
from kvrelay.bench.facts_window import FactsWindow
from kvrelay.bench.occupancy import OccupancySampler
from kvrelay.bench.scenarios.prompts import ScenarioPrompts
from kvrelay.bench.scenarios.stats import CaseSummary, Snapshot, summarize_case
from kvrelay.bench.streams import StreamRecord, new_records, run_streams

QUIESCE_S = 30.0

CASES: dict[str, str] = {
    "cold": "nothing cached: each request its own new prefix",
    "resident": "the shared prefix resident on one worker, different suffixes",
    "partial": "the first half of the shared prefix resident, the rest new",
    "ssd": "prefixes evicted from pages and ram, on the local ssd tier",
    "cancellation": "a third of the streams cancelled by their clients mid-decode",
    "restart": "the busiest worker killed mid-decode and restarted; requests continue",
    "object": "a fresh worker restores the prefixes from the object tier (S3 on moto_server)",
}


@dataclass(frozen=True, slots=True)
class ScenarioSizes:
    requests: int = 8
    concurrency: int = 4
    prefix_tokens: int = 1536
    suffix_tokens: int = 64
    new_tokens: int = 32
    flood_factor: float = 1.5
    """The flood before the ssd case sends this many times the pages of every worker, in prompt tokens."""
    seed: int = 0

    def flood_requests(self, workers: int, kv_tokens: int) -> int:
        return math.ceil(self.flood_factor * workers * kv_tokens / (self.prefix_tokens + self.suffix_tokens))

    def total_requests(self, workers: int, kv_tokens: int) -> int:
        """Every request the run sends, warm-ups and the flood included (for a progress bar)."""
        return 7 * self.requests + 2 + self.flood_requests(workers, kv_tokens)


class ScenarioRunner:
    def __init__(
        self,
        cluster: BenchCluster,
        sizes: ScenarioSizes,
        prompts: ScenarioPrompts,
        progress: Callable[[str, int], None],
    ) -> None:
        self.cluster = cluster
        self.sizes = sizes
        self.prompts = prompts
        self.progress = progress
        """``progress(stage, requests_done)``: called when a stage begins (0) and after each request."""
        self.model = cluster.model_name()
        self.facts = FactsWindow(f"sqlite:///{cluster.db_path}")
        self.sampler = OccupancySampler(cluster)
        self.summaries: list[CaseSummary] = []
        self.references: dict[int, str] = {}
        self._before: dict[str, Snapshot] = {}

    def run(self, cases: tuple[str, ...] = tuple(CASES)) -> list[CaseSummary]:
        self.sampler.start()
        try:
            for name in cases:
                getattr(self, f"case_{name}")()
        finally:
            self.sampler.stop()
            self.facts.close()
        return self.summaries

    # --- helpers -----------------------------------------------------------------------

    def _snapshots(self) -> dict[str, Snapshot]:
        """Full probe snapshots of the live workers, keyed by probe URL."""
        out = {}
        for worker_id, url in list(self.cluster.probes.items()):
            if (snap := self.cluster.probe(worker_id)) is not None:
                out[url] = snap
                self.sampler.record(worker_id, snap)
        return out

    def _begin(self, name: str) -> None:
        self.progress(name, 0)
        self._before = self._snapshots()

    def _send(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        concurrency: int,
        stage: str,
        cancel_after: dict[int, int] | None = None,
        records: list[StreamRecord] | None = None,
    ) -> list[StreamRecord]:
        return run_streams(
            self.cluster.http_url,
            self.model,
            prompts,
            max_tokens,
            concurrency,
            cancel_after,
            lambda r: self.progress(stage, 1),
            records,
        )

    def _held_bytes(self, after: dict[str, Snapshot]) -> dict[str, int]:
        held: dict[str, int] = {}
        for snap in after.values():
            for tier, n in snap["tier_bytes"].items():
                held[tier] = held.get(tier, 0) + int(n)
        held["object"] = self.cluster.object_bytes()
        return held

    def _finish(
        self,
        name: str,
        records: list[StreamRecord],
        window: tuple[float, float],
        checks: dict[str, float] | None = None,
    ) -> CaseSummary:
        after = self._snapshots()
        facts = self.facts.read(window[0], window[1] + 1.0, expect=len(records))
        summary = summarize_case(
            name,
            CASES[name],
            records,
            facts,
            self._before,
            after,
            self.sampler.samples,
            window,
            self._held_bytes(after),
        )
        summary.checks.update(checks or {})
        summary.checks["errors"] = sum(r.error is not None for r in records)
        gpu_tokens = self.sizes.prefix_tokens // 64 * 64
        summary.checks["requests_with_whole_prefix_on_gpu"] = sum(
            n for k, n in facts.gpu_hit_requests.items() if k >= gpu_tokens
        )
        summary.checks["continued_requests"] = facts.attempts_over_one
        self.summaries.append(summary)
        return summary

    def _measure(
        self,
        name: str,
        prompts: list[list[int]],
        concurrency: int | None = None,
        cancel_after: dict[int, int] | None = None,
    ) -> tuple[list[StreamRecord], tuple[float, float]]:
        start = time.monotonic()
        records = self._send(prompts, self.sizes.new_tokens, concurrency or self.sizes.concurrency, name, cancel_after)
        return records, (start, time.monotonic())

    def _warm_shared(self, stage: str) -> None:
        self._send([self.prompts.shared + self.prompts.fresh(self.sizes.suffix_tokens)], 1, 1, stage)

    def _identical(self, records: list[StreamRecord], indices: list[int]) -> int:
        return sum(records[i].completed and records[i].text == self.references.get(i) for i in indices)

    # --- the cases ---------------------------------------------------------------------

    def case_cold(self) -> None:
        self._begin("cold")
        records, window = self._measure("cold", [p + s for p, s in zip(self.prompts.prefixes, self.prompts.suffixes)])
        self._finish("cold", records, window)

    def case_resident(self) -> None:
        self._begin("resident")
        self._warm_shared("resident")
        prompts = [self.prompts.on_shared(j) for j in range(self.sizes.requests)]
        records, window = self._measure("resident", prompts)
        self.references = {r.index: r.text for r in records if r.completed}
        self._finish("resident", records, window)

    def case_partial(self) -> None:
        self._begin("partial")
        records, window = self._measure("partial", self.prompts.half_shared())
        self._finish("partial", records, window)

    def case_ssd(self) -> None:
        self._begin("ssd")
        flood = self.sizes.flood_requests(len(self.cluster.workers), self.cluster.spec.kv_tokens)
        length = self.sizes.prefix_tokens + self.sizes.suffix_tokens
        self._send([self.prompts.fresh(length) for _ in range(flood)], 1, self.sizes.concurrency, "ssd")
        records, window = self._measure("ssd", self.prompts.on_prefixes())
        self._finish("ssd", records, window, {"flood_requests": flood})

    def case_cancellation(self) -> None:
        self._begin("cancellation")
        self._warm_shared("cancellation")
        n = self.sizes.requests
        cancel = {i: max(1, self.sizes.new_tokens // 4) for i in range(0, n, 3)}
        records, window = self._measure(
            "cancellation", [self.prompts.on_shared(j) for j in range(n)], concurrency=n, cancel_after=cancel
        )
        survivors = [i for i in range(n) if i not in cancel]
        quiesce_s, leaked = self._quiesce()
        self._finish(
            "cancellation",
            records,
            window,
            {
                "cancelled_streams": sum(records[i].cancelled for i in cancel),
                "survivors": len(survivors),
                "survivors_completed": sum(records[i].completed for i in survivors),
                "survivors_identical_to_resident": self._identical(records, survivors),
                "leaked_pages": leaked,
                "quiesce_s": quiesce_s,
            },
        )

    def _quiesce(self) -> tuple[float, int]:
        """Seconds until no worker holds a referenced or reserved page (bounded), and how many are still held."""
        start = time.monotonic()
        held = -1
        while time.monotonic() - start < QUIESCE_S:
            snaps = self._snapshots().values()
            held = sum(s["pages"]["referenced"] + s["pages"]["reserved"] for s in snaps)
            if held == 0 and all(s["running"] == 0 for s in snaps):
                break
            threading.Event().wait(0.1)
        return time.monotonic() - start, held

    def case_restart(self) -> None:
        self._begin("restart")
        n = self.sizes.requests
        prompts = [self.prompts.on_shared(j) for j in range(n)]
        records = new_records(prompts)
        start = time.monotonic()
        streams = threading.Thread(
            target=self._send,
            name="restart-streams",
            args=(prompts, self.sizes.new_tokens, n, "restart", None, records),
        )
        streams.start()
        wanted = max(1, self.sizes.new_tokens // 4)
        while streams.is_alive() and sum(len(r.token_times) >= wanted for r in records) < max(1, n // 2):
            threading.Event().wait(0.02)
        victim = _busiest(self.cluster.cluster(), sorted(self.cluster.workers))
        killed_at = time.monotonic()
        in_flight = sum(not r.finish_reason and r.error is None for r in records)
        self.progress(f"restart: killed {victim}, starting it again", 0)
        self.cluster.kill_worker(victim)
        restart_s = self.cluster.start_worker(victim)
        streams.join()
        window = (start, time.monotonic())
        self._finish(
            "restart",
            records,
            window,
            {
                "streams_in_flight_at_kill": in_flight,
                "completed": sum(r.completed for r in records),
                "lost": sum(not r.completed for r in records),
                "identical_to_resident": self._identical(records, list(range(n))),
                "worker_restart_s": restart_s,
                "kill_at_s": killed_at - start,
            },
        )

    def case_object(self) -> None:
        self._begin("object")
        originals = sorted(self.cluster.workers)
        self.progress("object: starting a fresh worker w3, stopping " + ", ".join(originals), 0)
        launched = time.monotonic()
        self.cluster.launch_worker("w3")
        self.cluster.stop_workers(originals)
        self.cluster.await_worker("w3")
        start_s = time.monotonic() - launched
        self._before.update(self._snapshots())
        records, window = self._measure("object", self.prompts.on_prefixes())
        self._finish("object", records, window, {"fresh_worker_start_s": start_s})


def _busiest(cluster: dict[str, Any], workers: list[str]) -> str:
    """The worker that runs the most requests in flight (the first worker when none runs any)."""
    counts = {w: 0 for w in workers}
    for request in cluster.get("requests", {}).values():
        if request.get("worker_id") in counts:
            counts[request["worker_id"]] += 1
    return max(workers, key=lambda w: (counts[w], -workers.index(w)))
