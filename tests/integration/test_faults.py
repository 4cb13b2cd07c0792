"""Faults with real processes on loopback: a router and workers as ``kvrelay`` child processes.

The model is a tiny random Llama without an EOS id (greedy decoding always
runs to its budget), large enough that a 300-token answer takes seconds, so
a fault can land mid-decode. Every fault test streams the same greedy request
and compares it with the uninterrupted answer: the consumer must see every
token exactly once, in order, and exactly the budget.

Timeouts of the module's router: offers 1 s, worker expiry 4 s; the directed-partition test has its own
router with an expiry of 30 s.

Partition semantics (what ``test_directed_partition...`` checks): while
worker -> router bytes are held, offers and cancels still reach the worker.
The offer times out at the router, which cancels it (the cancel reaches the
worker, which fences the work and releases its reservation at once, while
still partitioned) and re-routes the request. When the partition heals before
expiry, the held acceptance, deltas and heartbeats arrive late: the stale ones
are dropped, and the worker stays live in the same epoch. When it outlasts
expiry, the router fences the epoch and closes the connection; the worker then
moves to a new epoch (fencing whatever the cancel had not) and reconnects:
that is the heartbeat-silence case, ``test_silent_worker...``.
"""

from __future__ import annotations

import shutil
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvrelay.testing.tcp_proxy import TcpProxy
from kvrelay.testing.tiny_models import make_tiny_model
from tests.support.processes import (
    ChildProcess,
    Router,
    StreamingRequest,
    complete,
    start_worker,
    stop_all,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12] * 4
BUDGET = 300
LONG_BUDGET = 1200
"""Long enough that the partitioned worker is still decoding when the offer times out."""
ROUTER_FLAGS = ("--offer-timeout-s", "1.0", "--worker-expiry-s", "4.0")
PARTITION_EXPIRY_S = 30.0
"""Longer than the partition of the directed-partition test, which outlasts a worker's start."""
PARTITION_ROUTER_FLAGS = ("--offer-timeout-s", "1.0", "--worker-expiry-s", str(PARTITION_EXPIRY_S))


@dataclass
class Cluster:
    home: Path
    model: Path
    router: Router
    workers: dict[str, ChildProcess] = field(default_factory=dict)
    reference: str = ""

    def start(self, *worker_ids: str, model: Path | None = None, url: str | None = None) -> None:
        """Start workers (in parallel) and wait until the router sees them live."""
        for wid in worker_ids:
            self.workers[wid] = start_worker(self.home, wid, url or self.router.workers_url, model or self.model)
        wait_until(
            lambda: set(worker_ids) <= set(self.router.live_workers()), 60, f"workers {worker_ids} live at the router"
        )

    def counters(self) -> dict[str, int]:
        return self.router.cluster()["router_counters"]

    def in_flight(self) -> dict[str, Any] | None:
        requests = self.router.cluster()["requests"]
        return next(iter(requests.values())) if len(requests) == 1 else None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    home = tmp_path_factory.mktemp("faults")
    model = make_tiny_model(
        "llama",
        home / "slowllama",
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=6,
        max_position_embeddings=2048,
        eos_token_id=None,
    )
    twin = home / "twinllama"
    shutil.copytree(model, twin)
    router = Router(home, model, "--model", str(twin), *ROUTER_FLAGS)
    c = Cluster(home, model, router)
    try:
        c.start("w1", "w2")
        out = complete(router.http_url, model.name, PROMPT, BUDGET)
        assert out["usage"]["completion_tokens"] == BUDGET
        c.reference = out["choices"][0]["text"]
        yield c
    finally:
        stop_all([*c.workers.values(), c.router.child])


def stream(c: Cluster, model: str | None = None) -> tuple[StreamingRequest, dict[str, Any]]:
    """Start the reference request and return it with its router-side state once it is decoding."""
    request = StreamingRequest(c.router.http_url, model or c.model.name, PROMPT, BUDGET)
    assert request.first.wait(60) and request.error is None, request.error
    state = wait_until(c.in_flight, 10, "the request in flight at the router")
    assert state["delivered"] < BUDGET
    return request, state


def holds_nothing(c: Cluster, wid: str) -> bool:
    """Whether ``wid``'s last heartbeat shows no page reserved or referenced."""
    view = c.router.live_workers().get(wid)
    return view is not None and view["pages_free"] + view["pages_evictable"] == view["pages_total"]


def assert_reference(c: Cluster, request: StreamingRequest) -> None:
    text = request.result(90)
    assert request.usage is not None and request.usage["completion_tokens"] == BUDGET
    assert request.finish_reason == "length"
    assert text == c.reference


def test_kill_9_mid_decode_continues_on_another_worker(cluster: Cluster) -> None:
    lost = cluster.counters().get("worker_lost_assignments", 0)
    request, state = stream(cluster)
    victim = state["worker_id"]
    cluster.workers.pop(victim).process.kill()
    assert_reference(cluster, request)
    assert cluster.counters()["worker_lost_assignments"] == lost + 1
    assert victim not in cluster.router.live_workers()
    cluster.start("w3")


def test_silent_worker_expires_is_fenced_and_comes_back_in_a_new_epoch(cluster: Cluster) -> None:
    expired = cluster.counters().get("workers_expired", 0)
    request, state = stream(cluster)
    wid = state["worker_id"]
    silent = cluster.workers[wid]
    old_epoch = cluster.router.live_workers()[wid]["epoch"]
    mark = silent.mark()
    silent.signal(signal.SIGSTOP)
    try:
        assert_reference(cluster, request)
        assert cluster.counters()["workers_expired"] == expired + 1
    finally:
        silent.signal(signal.SIGCONT)
    moved = silent.wait_for(rf"worker {wid}: connection to \S+ lost; now epoch (\d+)", 30, mark)
    assert int(moved.group(1)) > old_epoch
    # the old assignment was fenced by the new epoch and its pages came back; nothing of it was delivered twice
    released = silent.wait_for(
        rf"worker {wid} holds no reservations \(epoch (\d+); assignments finished "
        r"(\d+), cancelled (\d+)\)",
        30,
        mark,
    )
    assert int(released.group(1)) == int(moved.group(1)) and int(released.group(3)) >= 1
    back = wait_until(lambda: cluster.router.live_workers().get(wid), 30, f"{wid} live again")
    assert back["epoch"] == int(moved.group(1))
    wait_until(lambda: holds_nothing(cluster, wid), 10, f"a heartbeat of {wid} with every page free or cached")


def test_router_restart_workers_reconnect_without_restarting(cluster: Cluster) -> None:
    old = cluster.router
    pids = {wid: child.pid for wid, child in cluster.workers.items()}
    assert old.child.stop() == 0
    cluster.router = Router(
        cluster.home,
        cluster.model,
        "--model",
        str(cluster.home / "twinllama"),
        *ROUTER_FLAGS,
        port=old.port,
        worker_port=old.worker_port,
    )
    wait_until(lambda: set(pids) <= set(cluster.router.live_workers()), 30, "every worker reconnected")
    assert all(child.process.poll() is None and child.pid == pids[wid] for wid, child in cluster.workers.items())
    out = complete(cluster.router.http_url, cluster.model.name, PROMPT, BUDGET)
    assert out["choices"][0]["text"] == cluster.reference


def test_sigterm_lets_a_running_request_finish_within_the_grace_period(cluster: Cluster) -> None:
    """The fixture's workers have the default 10 s grace: a 300-token answer finishes on the worker itself."""
    before = cluster.counters()
    request, state = stream(cluster)
    wid = state["worker_id"]
    draining = cluster.workers.pop(wid)
    mark = draining.mark()
    draining.signal(signal.SIGTERM)
    assert_reference(cluster, request)
    assert draining.process.wait(30) == 0
    draining.wait_for(rf"worker {wid} holds no reservations \(epoch \d+; assignments finished [1-9]", 10, mark)
    assert "handed over" not in "\n".join(draining.lines[mark:])
    after = cluster.counters()
    assert after.get("retries", 0) == before.get("retries", 0)  # one attempt, on the draining worker
    assert after["finished_length"] == before.get("finished_length", 0) + 1


def test_directed_partition_offer_times_out_and_the_worker_releases_on_cancel(cluster: Cluster, tmp_path: Path) -> None:
    """Worker -> router bytes held; see the module docstring for what happens when.

    The partition lasts until pb, started during it, is live (seconds on a loaded machine): this test has its own
    router, with the module's offer timeout and an expiry of ``PARTITION_EXPIRY_S``, so that it heals before expiry.
    """
    twin = cluster.home / "twinllama"
    router = Router(tmp_path, twin, *PARTITION_ROUTER_FLAGS)
    part = Cluster(tmp_path, twin, router)
    proxy = TcpProxy(router.worker_port).start()
    prompt = PROMPT * 16
    try:
        part.start("pa", url=f"ws://127.0.0.1:{proxy.port}/workers")
        complete(router.http_url, twin.name, prompt, 1)  # pa's one-off costs paid
        pa = part.workers["pa"]
        epoch = router.live_workers()["pa"]["epoch"]
        timeouts = part.counters().get("offer_timeouts", 0)
        mark = pa.mark()
        proxy.block("upstream")
        request = StreamingRequest(router.http_url, twin.name, prompt, LONG_BUDGET)
        # pa is the only worker, so the router offers it there (not by residency against a second worker: once a
        # prefill of this prompt is cheap, the workers' measured fixed costs decide that); pa starts decoding, its
        # acceptance held. pb, started now, is where the request goes after the timeout.
        part.start("pb")
        # until pb is live the router may offer the request to pa again, and that offer times out as well: when the
        # second offer is reserved before the first one's release, pa first holds nothing after both are cancelled
        pa.wait_for(r"worker pa holds no reservations \(epoch \d+; assignments finished 1, cancelled [1-9]", 30, mark)
        assert part.counters()["offer_timeouts"] >= timeouts + 1
        assert proxy.forwarded["downstream"] > 0
        proxy.heal()
        text = request.result(90)
        assert request.usage is not None and request.usage["completion_tokens"] == LONG_BUDGET
        wait_until(lambda: part.counters().get("stale_dropped", 0) > 0, 10, "pa's held messages dropped as stale")
        uninterrupted = complete(router.http_url, twin.name, prompt, LONG_BUDGET)
        assert text == uninterrupted["choices"][0]["text"]
        assert part.counters().get("workers_expired", 0) == 0
        assert router.live_workers()["pa"]["epoch"] == epoch
        wait_until(lambda: holds_nothing(part, "pa"), 10, "a heartbeat of pa with every page free or cached")
    finally:
        proxy.close()
        stop_all([*part.workers.values(), router.child])
