"""Faults on a cluster across network namespaces, each schedule judged by the one invariant checker.

The cluster (``testing.netns_cluster``, shared by the session): PostgreSQL, S3
and the router on hosts of their own, workers w1, w2 (behind the proxy host)
and w3 (its chunk directory on a small tmpfs), and the client on its own
host; the router fences a worker silent for 3 s and re-offers after 2 s. Every
test streams a wave of greedy requests to the counting model, injects its
fault while they decode, heals it, and asserts ``testing.invariants.check``
finds nothing: each request ended once, its tokens once and in order, no
reservation left, one outcome each in the fact store, nothing in the router's
index that a worker does not hold. A test that stops a worker's link or
process also waits until the worker is live again, so the next one starts
from the whole cluster.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest

from kvrelay.launch.child import ChildTimeout
from kvrelay.testing import netfaults
from kvrelay.testing.counting_model import word_prompt
from kvrelay.testing.invariants import End, Verdict
from kvrelay.testing.netns_cluster import LabCluster, Schedule
from kvrelay.testing.streams import StreamLoad, StreamRecord

pytestmark = [pytest.mark.netns, pytest.mark.timeout(900)]

WAVE = 6
MAX_TOKENS = 96  # a stream decodes for seconds, so a fault lands mid-stream
STREAM_END_S = 300.0
FULL_DISK_WAVES = 6
FULL_DISK_LINE = re.compile("cannot write chunk .* No space left on device")


@dataclass
class Wave:
    lab: LabCluster
    load: StreamLoad
    schedule: Schedule
    offset: int
    verdict: Verdict = field(default_factory=Verdict)
    records: list[StreamRecord] = field(default_factory=list)

    def submit(self, n: int = WAVE) -> None:
        """``n`` more requests, prompts of 65 to 200 words (one to three routable chunks), all distinct."""
        for _ in range(n):
            k = len(self.load.records)
            self.load.submit(word_prompt(self.offset + 37 * k, 65 + (29 * k) % 136), MAX_TOKENS)

    def counter(self, name: str) -> int:
        return int(self.lab.router_status()["counters"].get(name, 0))

    def hold_until(self, what: str, probe: Callable[[], bool], timeout_s: float = 60.0) -> None:
        """Keep the fault on until ``probe()`` holds (the cluster noticed it)."""
        import time

        deadline = time.monotonic() + timeout_s
        while not probe():
            if time.monotonic() > deadline:
                raise AssertionError(f"the cluster did not show {what} within {timeout_s} s")
            time.sleep(0.1)

    def busiest(self, among: tuple[str, ...] = ("w1", "w3"), timeout_s: float = 30.0, resends: int = 3) -> str:
        """The worker of ``among`` that runs the most of this wave's requests, once one of them runs any.

        The router places a wave by each worker's measured speed, so it may put all of it on one worker, and on a
        quiet moment the tiny model may finish a wave before this looks; a fault on a worker that holds nothing
        would test nothing, so this sends the wave again (at most ``resends`` times) and fails with the placement
        it saw. Tests then count every request sent (``sent``)."""
        import time

        deadline = time.monotonic() + timeout_s
        while True:
            holders = Counter(r["worker_id"] for r in self.lab.cluster()["requests"].values())
            if any(holders[w] for w in among):
                return max(among, key=lambda w: (holders[w], w == among[0]))
            if time.monotonic() > deadline or not self.load.in_flight():
                if resends <= 0:
                    raise AssertionError(f"no worker of {among} ran a request of the wave; the router placed {holders}")
                resends -= 1
                self.submit()
                assert self.load.wait_started(120), "the resent wave did not start streaming"
                deadline = time.monotonic() + timeout_s
            time.sleep(0.05)

    @property
    def sent(self) -> int:
        """Requests this wave has sent so far."""
        return len(self.load.records)


@contextmanager
def fault_schedule(lab: LabCluster, offset: int) -> Iterator[Wave]:
    """A wave decoding when the body starts; after it: heal everything, every stream ended, the verdict clean."""
    schedule = Schedule(lab)
    wave = Wave(lab, lab.load(), schedule, offset)
    wave.submit()
    assert wave.load.wait_started(120), "the wave did not start streaming"
    try:
        yield wave
    finally:
        lab.heal_network()
        for wid in lab.workers:
            lab.thaw(wid)
        wave.records = wave.load.wait(STREAM_END_S)  # also after a failure: the next test starts from quiet
    wave.verdict = schedule.verify(wave.records)
    lab.wait_live(lab.settings.workers, 90)
    assert not wave.verdict.violations, "\n".join(wave.verdict.violations)


def completed(wave: Wave) -> int:
    return wave.verdict.count(End.COMPLETED)


def test_a_full_disk_under_a_workers_chunk_directory(lab: LabCluster) -> None:
    """w3's ssd tier cannot write: its chunks stay in ram and on the device, and the router never thinks w3 holds
    an ssd copy it failed to write.

    It needs the router to place work on w3, but an idle worker keeps the speeds it last learned (it re-measures
    only when it runs), and speeds learned on a loaded machine can make w3 look far slower than it is: CI saw w2
    and w3 report 100 times w1's prefill cost and get nothing in six waves of six. So each wave is larger than
    the last, until w1 and w2 queue enough that w3 starts sooner; and the test runs first in the module, before
    the other tests' faults."""
    victim = lab.settings.small_disk
    assert victim is not None
    worker = lab.workers[victim]
    mark = worker.mark()
    before = lab.worker_status(victim)["keys"]
    lab.fill_disk(victim)
    try:
        with fault_schedule(lab, 109) as wave:
            # The router may place a whole wave elsewhere, and new chunks in w3's ram do not always mean a write to
            # its ssd tier (CI saw them without one): send waves until w3 has tried to write a chunk there.
            for size in range(1, FULL_DISK_WAVES + 1):
                wave.submit(size * WAVE)  # larger each time: queues on w1 and w2 until the router uses w3
                wave.load.wait(STREAM_END_S)
                if any(FULL_DISK_LINE.search(line) for line in worker.lines[mark:]):
                    break
            workers = lab.cluster()["workers"]  # why, when the router gave the victim nothing to write
        try:
            worker.wait_for(FULL_DISK_LINE, 30, mark)
        except ChildTimeout as timeout:
            raise AssertionError(
                f"{victim} wrote no chunk in {FULL_DISK_WAVES} waves; the router saw {workers}"
            ) from timeout
        after = lab.worker_status(victim)["keys"]
    finally:
        lab.free_disk(victim)
    assert completed(wave) == wave.sent
    assert set(after["ssd"]) <= set(before["ssd"]), "nothing new fits on the full disk"
    assert set(after["ram"]) > set(before["ram"]), "the new chunks stayed in ram"


def test_random_loss_on_a_worker_link_loses_nothing(lab: LabCluster) -> None:
    host = lab.hosts["w1"]
    with fault_schedule(lab, 0) as wave:
        netfaults.drop_random(host, 10)
        wave.submit()
        wave.load.wait(STREAM_END_S)
        assert netfaults.dropped_packets(host) > 0
    assert completed(wave) == 2 * WAVE


def test_a_rate_limited_worker_link(lab: LabCluster) -> None:
    with fault_schedule(lab, 11) as wave:
        netfaults.limit_rate(lab.hosts["w1"], "1mbit")
        wave.submit()
        wave.load.wait(STREAM_END_S)
    assert completed(wave) == 2 * WAVE


def test_delay_jitter_and_reordering_between_a_worker_and_the_router(lab: LabCluster) -> None:
    """w2's link goes through the proxy: every chunk held 20 to 220 ms, so w2's frames arrive late and out of
    order with the other workers' (TCP keeps one connection's bytes in order; nothing else does)."""
    assert lab.proxy is not None
    with fault_schedule(lab, 23) as wave:
        before = lab.proxy.forwarded["upstream"]
        lab.proxy.delay(0.02, 0.2)
        wave.submit()
        wave.load.wait(STREAM_END_S)
        assert lab.proxy.forwarded["upstream"] > before
    assert completed(wave) == 2 * WAVE


def _expired_and_back(
    lab: LabCluster, wave: Wave, victim: str, cut: Callable[[], None], mend: Callable[[], None]
) -> None:
    """Cut ``victim`` off until the router fences it, mend, and wait until it is live again (a newer epoch)."""
    epoch = lab.router_status()["live_workers"][victim]
    expired = wave.counter("workers_expired")
    cut()
    wave.hold_until(f"{victim} fenced", lambda: wave.counter("workers_expired") > expired)
    mend()
    wave.hold_until(f"{victim} back", lambda: lab.router_status()["live_workers"].get(victim, epoch) > epoch, 90)


def test_directed_partition_from_a_worker_to_the_router_then_healed(lab: LabCluster) -> None:
    with fault_schedule(lab, 31) as wave:
        victim = wave.busiest()
        host, router = lab.hosts[victim], lab.hosts["router"]
        _expired_and_back(lab, wave, victim, lambda: netfaults.partition(host, router), lambda: netfaults.heal(host))
    assert completed(wave) == wave.sent


def test_directed_partition_from_the_router_to_a_worker_by_a_blackhole_route(lab: LabCluster) -> None:
    with fault_schedule(lab, 47) as wave:
        victim = wave.busiest()
        router = lab.hosts["router"]
        _expired_and_back(
            lab, wave, victim, lambda: netfaults.blackhole(router, lab.hosts[victim]), lambda: netfaults.heal(router)
        )
    assert completed(wave) == wave.sent


def test_a_worker_link_set_down_and_up(lab: LabCluster) -> None:
    with fault_schedule(lab, 59) as wave:
        victim = wave.busiest()
        host = lab.hosts[victim]
        _expired_and_back(lab, wave, victim, lambda: netfaults.cable(host, False), lambda: netfaults.cable(host, True))
    assert completed(wave) == wave.sent


def test_a_frozen_worker_is_fenced_and_thawed_into_a_new_epoch(lab: LabCluster) -> None:
    with fault_schedule(lab, 71) as wave:
        victim = wave.busiest()
        _expired_and_back(lab, wave, victim, lambda: lab.freeze(victim), lambda: lab.thaw(victim))
    assert completed(wave) == wave.sent


def test_kill_9_of_a_worker_mid_stream(lab: LabCluster) -> None:
    with fault_schedule(lab, 83) as wave:
        victim = wave.busiest(lab.settings.workers)  # the proxied w2 too: CI's wave once went there whole
        lost = wave.counter("worker_lost_assignments")
        lab.kill(victim)
        try:
            wave.hold_until("its assignments re-routed", lambda: wave.counter("worker_lost_assignments") > lost)
        finally:
            lab.start_worker(victim)  # also after a failure: the next test needs the whole cluster
    assert completed(wave) == wave.sent


def test_kill_9_of_the_router_mid_stream(lab: LabCluster) -> None:
    """Streams in flight end with a broken connection (their router is gone); the restarted router serves the
    next wave with the same workers, which reconnect in new epochs."""
    with fault_schedule(lab, 97) as wave:
        lab.kill("router")
        for record in wave.load.wait(60):
            assert record.ended_at is not None and (record.transport_error or record.finishes), record
        lab.start_router()
        lab.wait_live(lab.settings.workers, 90)
        wave.submit()
    broken = [r for r in wave.records[:WAVE] if r.transport_error]
    assert broken, "no stream was in flight when the router died"
    assert completed(wave) == 2 * WAVE - len(broken)
