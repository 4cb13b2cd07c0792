"""``kvrelay cluster`` under faults, as a user runs it: a killed router or worker is restarted, and says so
loudly; a child that keeps dying is left down, saying why; SIGTERM to the supervisor stops the cluster in an
order that loses nothing, and a stream that cannot finish ends with an error event that says why; the
children of a supervisor killed outright stop with it.

The first four tests share one cluster (w1, w2; at most one restart per child within 600 s) and run in
order: a router kill, a worker kill mid-stream, the same worker killed again, then the supervisor's SIGTERM.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from kvrelay.launch.child import ChildProcess, ChildTimeout
from kvrelay.testing.tiny_models import make_tiny_model
from tests.support.processes import (
    CLUSTER_READY,
    OpenAIStream,
    StreamingRequest,
    child_env,
    children_of,
    complete,
    kvrelay,
    two_worker_cluster,
    wait_until,
)

pytestmark = pytest.mark.timeout(240)

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12] * 4
BUDGET = 200
LONG = 4000
"""About 3 ms a token on an AMX Xeon: at least three drains' time, so the long stream cannot finish in one."""
SHORT = 8
DRAIN_S = 4.0


@dataclass
class Cluster:
    home: Path
    model: str
    supervisor: ChildProcess
    http_url: str
    reference: str = ""
    restarted: str = ""
    """The worker the supervisor restarted once already."""

    def pids(self, kind: str) -> dict[str, int]:
        """Live children of the supervisor by name (``router``, ``w1``, ...), for ``kind`` router or worker."""
        found = {}
        for pid, argv in children_of(self.supervisor.pid).items():
            if f" {kind} " in argv:
                match = re.search(r"--worker-id (w\d+)", argv)
                found[match.group(1) if match else "router"] = pid
        return found

    def cluster(self) -> dict[str, object]:
        return httpx.get(self.http_url + "/cluster", timeout=10).json()  # type: ignore[no-any-return]

    def live(self) -> dict[str, dict[str, object]]:
        try:
            return self.cluster()["workers"]  # type: ignore[return-value]
        except httpx.HTTPError:
            return {}

    def facts_pending(self) -> float:
        text = httpx.get(self.http_url + "/metrics", timeout=10).text
        match = re.search(r"^kvrelay_facts_pending (\S+)$", text, re.MULTILINE)
        assert match is not None
        return float(match.group(1))

    def outcomes(self) -> int:
        with contextlib.closing(sqlite3.connect(self.home / "facts.sqlite3")) as con:
            return int(con.execute("select count(*) from outcomes").fetchone()[0])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    home = tmp_path_factory.mktemp("supervised")
    model = make_tiny_model(
        "llama",
        home / "slowllama",
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=6,
        max_position_embeddings=4096,
        eos_token_id=None,
    )
    flags = ("--max-restarts", "1", "--restart-window-s", "600", "--drain-s", str(DRAIN_S), "--grace-s", "1")
    supervisor = two_worker_cluster(home, model, *flags)
    try:
        http_url = supervisor.wait_for(CLUSTER_READY, 120).group(1)
        c = Cluster(home, model.name, supervisor, http_url)
        c.reference = complete(http_url, model.name, PROMPT, BUDGET)["choices"][0]["text"]
        yield c
    finally:
        supervisor.stop(60)


def test_a_killed_router_is_restarted_on_its_port_and_the_workers_come_back_to_it(cluster: Cluster) -> None:
    mark = cluster.supervisor.mark()
    old = cluster.pids("router")["router"]
    os.kill(old, signal.SIGKILL)
    cluster.supervisor.wait_for(
        r"kvrelay cluster: router exited with signal SIGKILL; restarting it in \S+ s "
        r"\(restart 1 of at most 1 within 600 s\)",
        30,
        mark,
    )
    cluster.supervisor.wait_for(r"kvrelay cluster: router is back: kvrelay router ready", 60, mark)
    assert cluster.pids("router")["router"] != old
    wait_until(lambda: set(cluster.live()) == {"w1", "w2"}, 30, "both workers linked to the new router")
    assert complete(cluster.http_url, cluster.model, PROMPT, BUDGET)["choices"][0]["text"] == cluster.reference
    assert cluster.supervisor.process.poll() is None


def test_a_killed_worker_is_restarted_and_its_stream_continues_elsewhere(cluster: Cluster) -> None:
    request = StreamingRequest(cluster.http_url, cluster.model, PROMPT, BUDGET)
    assert request.first.wait(60)
    state = wait_until(lambda: next(iter(cluster.cluster()["requests"].values()), None), 10, "the request")  # type: ignore[attr-defined]
    victim = state["worker_id"]
    epoch = cluster.live()[victim]["epoch"]
    mark = cluster.supervisor.mark()
    os.kill(cluster.pids("worker")[victim], signal.SIGKILL)
    assert request.result(120) == cluster.reference and request.usage["completion_tokens"] == BUDGET  # type: ignore[index]
    cluster.supervisor.wait_for(
        rf"kvrelay cluster: worker {victim} exited with signal SIGKILL; restarting it in \S+ s "
        r"\(restart 1 of at most 1 within 600 s\)",
        30,
        mark,
    )
    back_line = rf"kvrelay cluster: worker {victim} is back: kvrelay worker ready id={victim}"
    cluster.supervisor.wait_for(back_line, 60, mark)
    back = wait_until(lambda: cluster.live().get(victim), 30, f"{victim} live again")
    assert back["epoch"] > epoch  # type: ignore[operator]
    cluster.restarted = victim


def test_a_worker_that_keeps_dying_is_left_down_and_the_supervisor_says_why(cluster: Cluster) -> None:
    again = cluster.restarted or "w1"
    mark = cluster.supervisor.mark()
    os.kill(cluster.pids("worker")[again], signal.SIGKILL)
    cluster.supervisor.wait_for(
        rf"kvrelay cluster: worker {again} exited with signal SIGKILL; not restarting it: it was restarted 1 times "
        r"within 600 s and keeps exiting; the cluster runs on with 1 workers",
        30,
        mark,
    )
    with pytest.raises(ChildTimeout):  # a restart would come within its delay (0.5 s); none comes
        cluster.supervisor.wait_for(rf"kvrelay cluster: worker {again} restarted", 2.0, mark)
    assert again not in cluster.pids("worker") and cluster.supervisor.process.poll() is None
    assert complete(cluster.http_url, cluster.model, PROMPT, 8)["usage"]["completion_tokens"] == 8


def test_sigterm_stops_the_router_first_and_a_stream_that_cannot_finish_says_why(cluster: Cluster) -> None:
    wait_until(lambda: cluster.facts_pending() == 0, 30, "the earlier tests' facts written")
    before = cluster.outcomes()
    short = [StreamingRequest(cluster.http_url, cluster.model, PROMPT, SHORT) for _ in range(2)]
    long = OpenAIStream(cluster.http_url, cluster.model, PROMPT, LONG)
    assert long.first.wait(60) and all(s.first.wait(60) for s in short)
    cluster.supervisor.signal(signal.SIGTERM)
    assert cluster.supervisor.process.wait(DRAIN_S + 60) == 0
    for s in short:
        s.result(10)
        assert s.error_event is None and s.usage["completion_tokens"] == SHORT  # type: ignore[index]
    assert long.done.wait(10) and isinstance(long.error, openai.APIError), long.error
    assert "shut down before the request finished" in long.error.message
    assert f"of {LONG} tokens were delivered" in long.error.message
    assert cluster.outcomes() == before + 3  # every request's outcome was written
    assert not children_of(cluster.supervisor.pid)


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (not gone, not a zombie)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return re.search(r"^State:\s+Z", status, re.MULTILINE) is None


def test_the_children_of_a_killed_supervisor_stop_with_it(tmp_path: Path) -> None:
    model = make_tiny_model("llama", tmp_path / "tiny")
    args = ["--workers", "1", "--port", "0", "--model", str(model), "--dtype", "float32", "--kv-tokens", "1024"]
    args += ["--db", f"sqlite:///{tmp_path / 'facts.sqlite3'}"]
    supervisor = kvrelay("cluster", "cluster", args, child_env(tmp_path))
    children: dict[int, str] = {}
    try:
        supervisor.wait_for(r"kvrelay cluster ready http=\S+ workers=w1", 120)
        children = children_of(supervisor.pid)
        assert len(children) == 2  # the router and w1
        supervisor.process.kill()
        supervisor.process.wait()
        wait_until(lambda: not any(running(pid) for pid in children), 60, "the router and worker to stop")
    finally:
        supervisor.stop()
        for pid in children:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
