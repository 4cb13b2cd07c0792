"""A worker's residency snapshot on every new link: the router's index lists what the worker holds, no more.

Found by the namespace fault tests (``tests/netns``): a worker killed with
``kill -9`` came back with an empty chunk directory (a tmpfs that died with
it), and the router, which re-learns a restarted worker's ssd chunks from the
fact store's replica facts, listed 47 ssd chunks the worker no longer had.
Now each link starts with a snapshot of the worker's tiers, which replaces
what the router believed.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

from kvrelay.launch.cluster import WORKER_READY, status_url
from kvrelay.testing.counting_model import make_counting_model, word_prompt
from tests.support.processes import Router, complete, start_worker, stop_all, wait_until

pytestmark = pytest.mark.timeout(240)


def index_of(router: Router, worker_id: str) -> dict[str, set[str]]:
    tiers = router.status()["index"]["workers"].get(worker_id, {})
    return {tier: set(keys) for tier, keys in tiers.items()}


def test_a_worker_restarted_with_a_wiped_chunk_directory_is_not_credited_with_its_old_chunks(tmp_path: Path) -> None:
    model = make_counting_model(tmp_path / "counting")
    chunks = tmp_path / "w1-chunks"
    router = Router(tmp_path, model)
    flags = ("--chunk-dir", str(chunks))
    worker = start_worker(tmp_path, "w1", router.workers_url, model, *flags)
    children = [router.child, worker]
    try:
        wait_until(lambda: "w1" in router.live_workers(), 120, "w1 live")
        out = complete(router.http_url, model.name, word_prompt(0, 200), 4)
        assert out["usage"]["completion_tokens"] == 4
        stored = wait_until(lambda: index_of(router, "w1").get("ssd"), 30, "w1's ssd chunks in the router's index")
        epoch = router.live_workers()["w1"]["epoch"]
        worker.process.kill()
        worker.process.wait(10)
        shutil.rmtree(chunks)
        worker = start_worker(tmp_path, "w1", router.workers_url, model, *flags)
        children.append(worker)
        ready = worker.wait_for(WORKER_READY, 120)
        wait_until(lambda: router.live_workers().get("w1", {}).get("epoch", epoch) > epoch, 60, "w1 in a new epoch")
        held = httpx.get(status_url(ready.string), timeout=10).json()["keys"]
        assert held["ssd"] == [] and held["gpu"] == []
        wait_until(
            lambda: not index_of(router, "w1").get("ssd"), 30, f"the router forgetting {len(stored)} lost chunks"
        )
        assert not index_of(router, "w1").get("gpu")
        assert router.status()["counters"]["residency_snapshots"] >= 6  # gpu, ram and ssd of both epochs
        # the snapshot's removals reached the fact store's replica facts too: a router restarted now learns none
        assert router.child.stop() == 0
        router = Router(tmp_path, model, port=router.port, worker_port=router.worker_port)
        children.append(router.child)
        wait_until(lambda: "w1" in router.live_workers(), 60, "w1 back at the restarted router")
        wait_until(lambda: router.status()["counters"].get("residency_snapshots", 0) >= 3, 30, "a snapshot")
        assert not index_of(router, "w1").get("ssd")
    finally:
        stop_all(children)
