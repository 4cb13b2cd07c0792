"""A kvrelay cluster across network namespaces: each process on a host of its own, as a user would run it.

``LabCluster(home, settings).start()`` builds a ``testing.netns`` lab with a
host for PostgreSQL, one for S3 (``moto_server``), one for the router, one per
worker, one for the client and one for a TCP proxy; it starts PostgreSQL and
moto there (``testing.lab_services``), then ``kvrelay router --host ROUTER_IP
--db postgresql+psycopg://...@PG_IP/...`` and ``kvrelay worker --router
ws://ROUTER_IP:8001/workers --s3-endpoint http://S3_IP:5000 --peer-host
WORKER_IP ...`` exactly as on separate machines, serving the counting model
(``testing.counting_model``). One worker (``settings.proxied``) reaches the
router through the proxy host, where ``proxy.delay(...)`` adds delay and
jitter; one (``settings.small_disk``) keeps its chunk directory on a small
tmpfs mounted in its own mount namespace, which ``fill_disk`` can fill.

Processes: ``kill(name)`` (``kill -9``), ``freeze``/``thaw`` (``SIGSTOP`` /
``SIGCONT``), ``start_worker``/``start_router`` again. Clients: ``load()``
gives a ``StreamLoad`` on the client host. Invariants: ``snapshot(records)``
waits until the cluster is quiet and returns the ``testing.invariants``
``Snapshot`` (status views read inside each host, on its loopback, where the
status listeners listen by default); ``verify(records)`` is the checker's
verdict. ``close()`` stops everything and removes the lab; each process's
output is kept in ``home/logs/``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvrelay.launch.child import ChildProcess
from kvrelay.launch.cluster import ROUTER_READY, WORKER_READY, status_url
from kvrelay.testing import netfaults
from kvrelay.testing.counting_model import make_counting_model
from kvrelay.testing.invariants import Outcome, Snapshot, Verdict, check, cluster_violations
from kvrelay.testing.lab_services import BUCKET, S3_CREDENTIALS, Service, s3_client, start_moto, start_postgres
from kvrelay.testing.netns import Host, NetLab
from kvrelay.testing.streams import StreamLoad, StreamRecord
from kvrelay.testing.tcp_proxy import TcpProxy

HTTP_PORT, WORKER_PORT = 8000, 8001
SECRET = "kvrelay-lab-secret-0123456789abcdef"
S3_PREFIX = "kvrelay/"


@dataclass(frozen=True)
class LabSettings:
    """The cluster's shape and timeouts (short, so faults resolve within a test)."""

    workers: tuple[str, ...] = ("w1", "w2", "w3")
    proxied: str | None = "w2"
    small_disk: str | None = "w3"
    small_disk_bytes: int = 16 << 20
    offer_timeout_s: float = 2.0
    progress_timeout_s: float = 30.0
    worker_expiry_s: float = 3.0
    heartbeat_s: float = 0.2
    kv_tokens: int = 4096
    lanes: int = 4
    model_name: str = "counting"


class LabCluster:
    def __init__(self, home: Path, settings: LabSettings = LabSettings()) -> None:
        self.home = home
        self.settings = settings
        self.model = home / settings.model_name
        self.lab: NetLab | None = None
        self.hosts: dict[str, Host] = {}
        self.services: list[Service] = []
        self.proxy: TcpProxy | None = None
        self.router: ChildProcess | None = None
        self.router_status_url = ""
        self.router_starts = 0
        self.router_killed_at: float | None = None
        self.workers: dict[str, ChildProcess] = {}
        self.worker_status_urls: dict[str, str] = {}
        self.db_url = ""
        self.s3_url = ""

    # --- lifecycle ----------------------------------------------------------------

    def start(self) -> LabCluster:
        if not (self.model / "config.json").exists():
            make_counting_model(self.model)
        self.lab = NetLab()
        try:
            for name in ("pg", "s3", "router", "client", "proxy", *self.settings.workers):
                self.hosts[name] = self.lab.add_host(name)
            pg, s3 = start_postgres(self.hosts["pg"]), start_moto(self.hosts["s3"])
            self.services += [pg, s3]
            self.db_url, self.s3_url = pg.url, s3.url
            self.start_router()
            proxy_host = self.hosts["proxy"]
            self.proxy = TcpProxy(
                WORKER_PORT, self.hosts["router"].ip, proxy_host.ip, WORKER_PORT, netns=proxy_host.netns
            ).start()
            for wid in self.settings.workers:
                self.start_worker(wid, wait=False)
            for wid in self.settings.workers:
                self._wait_worker_ready(wid)
            self.wait_live(self.settings.workers)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        for child in [*self.workers.values(), *([self.router] if self.router else [])]:
            child.stop(20, sig=signal.SIGKILL)
            self._keep_log(child)
        self.workers.clear()
        if self.proxy is not None:
            self.proxy.close()
            self.proxy = None
        for service in self.services:
            service.close()
        self.services.clear()
        if self.lab is not None:
            self.lab.close()
            self.lab = None

    # --- processes ----------------------------------------------------------------

    def _env(self, name: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVRELAY_")}
        env.update(
            KVRELAY_SECRET=SECRET,
            KVRELAY_CACHE_DIR=str(self.home / "cache"),
            KVRELAY_DATA_DIR=str(self.home / name),
            PYTHONUNBUFFERED="1",
            **S3_CREDENTIALS,
        )
        return env

    def start_router(self) -> None:
        """``kvrelay router`` on the router host (again, after a kill); returns once it is ready."""
        s = self.settings
        host = self.hosts["router"]
        args = ["--host", host.ip, "--port", str(HTTP_PORT), "--worker-port", str(WORKER_PORT)]
        args += ["--model", str(self.model), "--db", self.db_url, "--offer-timeout-s", str(s.offer_timeout_s)]
        args += ["--progress-timeout-s", str(s.progress_timeout_s), "--worker-expiry-s", str(s.worker_expiry_s)]
        argv = [sys.executable, "-m", "kvrelay.cli.main", "--log-level", "INFO", "router", *args]
        self.router = ChildProcess("router", host.argv(argv), self._env("router"))
        ready = self.router.wait_for(ROUTER_READY, 120)
        self.router_status_url = status_url(ready.string)
        self.router_starts += 1

    def router_url(self, wid: str) -> str:
        """The worker WebSocket URL ``wid`` dials: the router's, or the proxy's for the proxied worker."""
        via = "proxy" if wid == self.settings.proxied else "router"
        return f"ws://{self.hosts[via].ip}:{WORKER_PORT}/workers"

    def chunk_dir(self, wid: str) -> str:
        return str(self.home / wid / "chunks")

    def start_worker(self, wid: str, wait: bool = True) -> None:
        """``kvrelay worker`` on its host (again, after a kill); with ``wait``, returns once it is ready."""
        s = self.settings
        host = self.hosts[wid]
        args = ["--worker-id", wid, "--router", self.router_url(wid), "--model", str(self.model)]
        args += ["--dtype", "float32", "--kv-tokens", str(s.kv_tokens), "--lanes", str(s.lanes)]
        args += ["--heartbeat-s", str(s.heartbeat_s), "--chunk-dir", self.chunk_dir(wid), "--peer-host", host.ip]
        args += ["--s3-endpoint", self.s3_url, "--s3-bucket", BUCKET, "--s3-prefix", S3_PREFIX]
        command = [sys.executable, "-m", "kvrelay.cli.main", "--log-level", "INFO", "worker", *args]
        if wid == s.small_disk:
            mount = f'mkdir -p "$0" && mount -t tmpfs -o size={s.small_disk_bytes} kvlab "$0" && exec "$@"'
            command = ["sh", "-c", mount, self.chunk_dir(wid), *command]
        else:
            Path(self.chunk_dir(wid)).mkdir(parents=True, exist_ok=True)
        self.workers[wid] = ChildProcess(wid, host.argv(command), self._env(wid))
        if wait:
            self._wait_worker_ready(wid)

    def _wait_worker_ready(self, wid: str) -> None:
        self.worker_status_urls[wid] = status_url(self.workers[wid].wait_for(WORKER_READY, 180).string)

    def kill(self, name: str) -> None:
        """``kill -9`` the router or a worker, and reap it."""
        child = self.router if name == "router" else self.workers.pop(name)
        assert child is not None
        child.process.kill()
        child.process.wait(10)
        if name == "router":
            self.router_killed_at = time.monotonic()
        self._keep_log(child)

    def _keep_log(self, child: ChildProcess) -> None:
        """Write a finished child's output to ``home/logs/<name>-<pid>.log`` (for a failed test's post-mortem)."""
        logs = self.home / "logs"
        logs.mkdir(exist_ok=True)
        (logs / f"{child.name}-{child.pid}.log").write_text("\n".join(child.lines) + "\n")

    def freeze(self, wid: str) -> None:
        self.workers[wid].signal(signal.SIGSTOP)

    def thaw(self, wid: str) -> None:
        self.workers[wid].signal(signal.SIGCONT)

    def fill_disk(self, wid: str) -> None:
        netfaults.fill_disk(self.workers[wid].pid, self.chunk_dir(wid))

    def free_disk(self, wid: str) -> None:
        netfaults.free_disk(self.workers[wid].pid, self.chunk_dir(wid))

    def heal_network(self) -> None:
        """Undo every network fault on every host, the proxy's included."""
        for host in self.hosts.values():
            netfaults.heal(host)
        if self.proxy is not None:
            self.proxy.heal()

    # --- views --------------------------------------------------------------------

    def http_url(self) -> str:
        return f"http://{self.hosts['router'].ip}:{HTTP_PORT}"

    def load(self) -> StreamLoad:
        return StreamLoad(self.hosts["client"].netns, self.http_url(), self.settings.model_name)

    def _get(self, host: str, url: str) -> Any:
        return self.hosts[host].call(lambda: httpx.get(url, timeout=10).raise_for_status().json(), timeout=30)

    def cluster(self) -> dict[str, Any]:
        """The router's ``/cluster`` view, read from the client host."""
        return self._get("client", self.http_url() + "/cluster")

    def router_status(self) -> dict[str, Any]:
        return self._get("router", self.router_status_url)

    def worker_status(self, wid: str) -> dict[str, Any]:
        return self._get(wid, self.worker_status_urls[wid])

    def finished_count(self) -> int:
        return sum(v for k, v in self.router_status()["counters"].items() if k.startswith("finished_"))

    def wait_live(self, wids: tuple[str, ...] | list[str], timeout_s: float = 60.0) -> None:
        """Until the router sees every worker of ``wids`` live."""
        deadline = time.monotonic() + timeout_s
        while not set(wids) <= set(self._live()):
            if time.monotonic() > deadline:
                raise AssertionError(f"workers {sorted(set(wids) - set(self._live()))} not live at the router")
            time.sleep(0.1)

    def _live(self) -> list[str]:
        try:
            return list(self.router_status()["live_workers"])
        except (httpx.HTTPError, OSError):
            return []

    def object_keys(self) -> set[str]:
        def listing() -> set[str]:
            pages = s3_client(self.s3_url).get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=S3_PREFIX)
            names = [obj["Key"] for page in pages for obj in page.get("Contents", ())]
            return {name[len(S3_PREFIX) : -len(".kvc")] for name in names if name.endswith(".kvc")}

        return self.hosts["client"].call(listing)

    def outcomes(self, request_ids: list[str]) -> dict[str, Outcome]:
        def read() -> dict[str, Outcome]:
            import sqlalchemy as sa

            from kvrelay.facts.schema import outcomes

            engine = sa.create_engine(self.db_url)
            try:
                with engine.connect() as conn:
                    query = sa.select(outcomes).where(outcomes.c.request_id.in_(request_ids))
                    return {
                        row.request_id: Outcome(row.finish_reason, row.generated_tokens, row.error)
                        for row in conn.execute(query)
                    }
            finally:
                engine.dispose()

        return self.hosts["client"].call(read) if request_ids else {}

    def decisions(self) -> list[dict[str, Any]]:
        """Every routing decision in the fact store, in order (for a post-mortem)."""

        def read() -> list[dict[str, Any]]:
            import sqlalchemy as sa

            from kvrelay.facts.schema import decisions

            engine = sa.create_engine(self.db_url)
            try:
                with engine.connect() as conn:
                    columns = [decisions.c[n] for n in ("request_id", "attempt", "time", "chosen_worker")]
                    columns += [decisions.c.outcome, decisions.c.outcome_reason, decisions.c.excluded]
                    rows = conn.execute(sa.select(*columns).order_by(decisions.c.id))
                    return [dict(row._mapping) for row in rows]
            finally:
                engine.dispose()

        return self.hosts["client"].call(read)

    def post_mortem(self, records: list[StreamRecord], snapshot: Snapshot, verdict: Verdict) -> Path:
        """Write the violations, the records, the snapshot and the decisions to ``home/logs/post-mortem-N.json``."""
        logs = self.home / "logs"
        logs.mkdir(exist_ok=True)
        path = logs / f"post-mortem-{len(list(logs.glob('post-mortem-*')))}.json"
        evidence = {
            "violations": verdict.violations,
            "records": [{k: v for k, v in vars(r).items() if k != "started"} for r in records],
            "router": snapshot.router | {"index": "(omitted)"},
            "workers": {
                w: s | {"keys": {t: len(k) for t, k in s["keys"].items()}} for w, s in snapshot.workers.items()
            },
            "decisions": self.decisions(),
        }
        path.write_text(json.dumps(evidence, indent=1, default=str))
        return path

    def take_snapshot(self, records: list[StreamRecord], finished_before: int | None, starts_before: int) -> Snapshot:
        router = self.router_status()
        restarted = self.router_starts != starts_before
        finished = None if restarted or finished_before is None else self.finished_count() - finished_before
        return Snapshot(
            router=router,
            workers={wid: self.worker_status(wid) for wid in sorted(self.workers)},
            object_keys=self.object_keys(),
            outcomes=self.outcomes([r.request_id for r in records if r.request_id]),
            finished=finished,
            router_restarted=restarted,
            router_killed_at=self.router_killed_at if restarted else None,
        )

    def snapshot(
        self, records: list[StreamRecord], finished_before: int | None, starts_before: int, timeout_s: float = 30.0
    ) -> Snapshot:
        """The cluster's state once quiet: retaken until its own invariants hold, or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        while True:
            snap = self.take_snapshot(records, finished_before, starts_before)
            if not cluster_violations(records, snap) or time.monotonic() > deadline:
                return snap
            time.sleep(0.25)


class Schedule:
    """One fault schedule's bookkeeping: the router's counts when it began, and the checker's verdict at its end."""

    def __init__(self, cluster: LabCluster) -> None:
        self.cluster = cluster
        self.finished_before = cluster.finished_count()
        self.starts_before = cluster.router_starts

    def verify(self, records: list[StreamRecord], timeout_s: float = 30.0) -> Verdict:
        """The checker's verdict; when it finds violations, the evidence is written to ``home/logs/`` first."""
        snap = self.cluster.snapshot(records, self.finished_before, self.starts_before, timeout_s)
        verdict = check(records, snap)
        if verdict.violations:
            self.cluster.post_mortem(records, snap, verdict)
        return verdict
