"""Background sampling of every live worker's page pool, through the workers' probes.

``OccupancySampler(cluster, interval_s)`` polls each probe once per round on a
daemon thread between ``start`` and ``stop``; every sample of a round carries
the round's start time. A worker that does not answer (stopped, killed) is
skipped for that round. ``record`` adds a sample from a snapshot taken elsewhere
(a round of its own, at the snapshot's time).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from kvrelay.bench.cluster import BenchCluster
from kvrelay.bench.scenarios.stats import OccupancySample


class OccupancySampler:
    def __init__(self, cluster: BenchCluster, interval_s: float = 0.5) -> None:
        self.cluster = cluster
        self.interval_s = interval_s
        self.samples: list[OccupancySample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="occupancy-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10.0)

    def record(self, worker_id: str, snap: dict[str, Any], at: float | None = None) -> None:
        """Keep the pages of one probe snapshot (taken at ``at``, default the snapshot's own time)."""
        pages = snap["pages"]
        self.samples.append(
            OccupancySample(
                snap["time"] if at is None else at,
                worker_id,
                pages["total"],
                pages["free"],
                pages["cached"],
                pages["referenced"] + pages["reserved"],
            )
        )

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            for worker_id in list(self.cluster.probes):
                snap = self.cluster.probe(worker_id, full=False)
                if snap is not None:
                    self.record(worker_id, snap, now)
