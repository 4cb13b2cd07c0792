"""A local cluster for benchmarks: a ``moto_server``, a router and probed worker processes.

Contract of ``BenchCluster``:
- ``start(worker_ids)`` starts ``moto_server`` on a free loopback port (its
  bucket created through ``boto3``), then ``kvrelay router`` (SQLite fact store
  under ``work_dir``) and, at the same time, one probed ``kvrelay worker`` per
  id (see ``worker_probe``; workers retry until the router listens), and
  returns once the router lists every worker as live.
- Each worker keeps its own ssd tier (``work_dir/chunks/<id>``), a small ram
  tier and the S3 object tier; ``start_worker`` of an id that ran before
  reuses its chunk directory (a restart), a new id starts empty (a fresh worker).
- ``stop_workers`` sends SIGTERM and waits (the workers drain); ``kill_worker``
  sends SIGKILL. A worker's probe is listed in ``probes`` only while it is
  live. ``close`` stops every child it started, workers first.
- Children log to ``log_path``; their stdout is read for ready lines only.
A child that fails to start raises ``ClusterError`` with its log's tail.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvrelay.launch import defaults
from kvrelay.launch.child import ChildProcess, ChildTimeout
from kvrelay.launch.cluster import ROUTER_READY, WORKER_READY
from kvrelay.paths import CACHE_ENV, DATA_ENV
from kvrelay.testing.moto import moto_server_command
from kvrelay.testing.ports import free_port
from kvrelay.transport.auth import SECRET_ENV_VAR

READY_TIMEOUT_S = 180.0
BUCKET = "kvrelay-bench"


class ClusterError(RuntimeError):
    """A child of the benchmark cluster did not start or stopped unexpectedly."""


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    work_dir: Path
    model: str | None = None
    """A model directory or .gguf file; None: the default Gemma 3 270M."""
    dtype: str = defaults.DTYPE
    kv_tokens: int = 8192
    lanes: int = defaults.LANES
    ram_bytes: int = 32 << 20
    heartbeat_s: float = 0.25
    worker_flags: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Further ``kvrelay worker`` flags, by worker id."""

    @property
    def log_path(self) -> Path:
        return self.work_dir / "cluster.log"


def _wait_line(child: ChildProcess, pattern: str | re.Pattern[str], log_path: Path) -> re.Match[str]:
    """``child``'s first line matching ``pattern``; ``ClusterError`` with the cluster log's tail if none comes."""
    try:
        return child.wait_for(pattern, READY_TIMEOUT_S)
    except ChildTimeout as exc:
        raise ClusterError(f"{exc}\nthe cluster log, {log_path}, ends:\n{_tail(log_path)}") from None


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _moto_command() -> str:
    try:
        return moto_server_command()
    except RuntimeError as exc:
        raise ClusterError(str(exc)) from None


class BenchCluster:
    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        spec.work_dir.mkdir(parents=True, exist_ok=True)
        self._log = spec.log_path.open("a")
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("KVRELAY_") or k == CACHE_ENV}
        self.env.update(
            {SECRET_ENV_VAR: secrets.token_urlsafe(32), DATA_ENV: str(spec.work_dir / "data")},
            PYTHONUNBUFFERED="1",
            AWS_ACCESS_KEY_ID="testing",
            AWS_SECRET_ACCESS_KEY="testing",
            AWS_DEFAULT_REGION="us-east-1",
        )
        self.env.pop("AWS_PROFILE", None)
        self.db_path = spec.work_dir / "facts.sqlite3"
        self.s3_endpoint = ""
        self.http_url = ""
        self.workers_url = ""
        self.probes: dict[str, str] = {}
        self.workers: dict[str, ChildProcess] = {}
        self._others: list[ChildProcess] = []
        self.http = httpx.Client(timeout=10.0)

    def start(self, worker_ids: list[str]) -> None:
        self._start_moto()
        http_port, worker_port = free_port(), free_port()
        self.workers_url = f"ws://127.0.0.1:{worker_port}/workers"
        argv = [
            sys.executable,
            "-m",
            "kvrelay.cli.main",
            "--log-level",
            "WARNING",
            "router",
            "--port",
            str(http_port),
            "--worker-port",
            str(worker_port),
            "--db",
            f"sqlite:///{self.db_path}",
        ]
        router = ChildProcess(
            "router", argv + (["--model", self.spec.model] if self.spec.model else []), self.env, stderr=self._log
        )
        self._others.append(router)
        for wid in worker_ids:  # workers start loading at once and connect when the router listens
            self.launch_worker(wid)
        ready = _wait_line(router, ROUTER_READY, self.spec.log_path)
        self.http_url = ready.group(1)
        for wid in worker_ids:
            self.await_worker(wid)

    def _start_moto(self) -> None:
        port = free_port()
        moto = ChildProcess(
            "moto_server", [_moto_command(), "-H", "127.0.0.1", "-p", str(port)], self.env, stderr=self._log
        )
        self._others.append(moto)
        self.s3_endpoint = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60.0
        while True:
            try:
                httpx.get(self.s3_endpoint, timeout=1.0)
                break
            except httpx.HTTPError:
                if moto.process.poll() is not None or time.monotonic() > deadline:
                    raise ClusterError(
                        f"moto_server did not answer on {self.s3_endpoint}; log:\n{_tail(self.spec.log_path)}"
                    ) from None
                time.sleep(0.1)
        self.s3_client().create_bucket(Bucket=BUCKET)

    def s3_client(self) -> Any:
        """A boto3 client of the cluster's moto_server (its dummy credentials)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.s3_endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )

    def object_bytes(self) -> int:
        """Bytes the object tier holds (every object of the bucket)."""
        pages = self.s3_client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET)
        return sum(obj["Size"] for page in pages for obj in page.get("Contents", ()))

    def launch_worker(self, worker_id: str) -> None:
        """Start a probed worker process (without waiting for it)."""
        spec = self.spec
        argv = [
            sys.executable,
            "-m",
            "kvrelay.cli.probed_worker",
            "--worker-id",
            worker_id,
            "--router",
            self.workers_url,
            "--dtype",
            spec.dtype,
            "--kv-tokens",
            str(spec.kv_tokens),
            "--lanes",
            str(spec.lanes),
            "--ram-bytes",
            str(spec.ram_bytes),
            "--chunk-dir",
            str(spec.work_dir / "chunks" / worker_id),
            "--s3-endpoint",
            self.s3_endpoint,
            "--s3-bucket",
            BUCKET,
            "--heartbeat-s",
            str(spec.heartbeat_s),
            "--grace-s",
            "5",
        ]
        if spec.model:
            argv += ["--model", spec.model]
        argv += spec.worker_flags.get(worker_id, ())
        self.workers[worker_id] = ChildProcess(worker_id, argv, self.env, stderr=self._log)

    def await_worker(self, worker_id: str) -> None:
        """Wait until ``worker_id``'s probe and worker are ready and the router lists it."""
        child = self.workers[worker_id]
        probe = _wait_line(child, r"kvrelay probe ready id=\S+ url=(\S+)", self.spec.log_path)
        _wait_line(child, WORKER_READY, self.spec.log_path)
        self.wait_until(lambda: worker_id in self.live_workers(), READY_TIMEOUT_S, f"worker {worker_id} to be live")
        self.probes[worker_id] = probe.group(1)

    def start_worker(self, worker_id: str) -> float:
        """Start ``worker_id`` and wait until it is live; the seconds that took."""
        started = time.monotonic()
        self.launch_worker(worker_id)
        self.await_worker(worker_id)
        return time.monotonic() - started

    def stop_workers(self, worker_ids: list[str]) -> None:
        """SIGTERM the workers at once, wait for each to exit and for the router to drop them."""
        children = [self.workers.pop(w) for w in worker_ids]
        for worker_id in worker_ids:
            self.probes.pop(worker_id, None)
        for child in children:
            child.signal(signal.SIGTERM)
        for child in children:
            child.stop(30.0)
        self.wait_until(
            lambda: not set(worker_ids) & set(self.live_workers()), 30.0, f"workers {', '.join(worker_ids)} to leave"
        )

    def kill_worker(self, worker_id: str) -> None:
        self.probes.pop(worker_id, None)
        self.workers.pop(worker_id).stop(30.0, signal.SIGKILL)

    def cluster(self) -> dict[str, Any]:
        return self.http.get(self.http_url + "/cluster").json()

    def live_workers(self) -> dict[str, Any]:
        return self.cluster()["workers"]

    def probe(self, worker_id: str, full: bool = True) -> dict[str, Any] | None:
        """The worker's probe snapshot (``full``: with restore and decode intervals); None when it does not
        answer (the worker is gone). Safe to call from any thread."""
        url = self.probes.get(worker_id)
        if url is None:
            return None
        try:
            response = httpx.get(url + ("/probe" if full else "/probe/pages"), timeout=3.0)
            return response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    def model_name(self) -> str:
        return self.http.get(self.http_url + "/v1/models").json()["data"][0]["id"]

    def wait_until(self, predicate: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"timed out after {timeout:.0f} s waiting for {what}; log:\n{_tail(self.spec.log_path)}"
                )
            threading.Event().wait(0.1)

    def close(self) -> None:
        for child in list(self.workers.values()):
            child.stop(30.0)
        self.workers.clear()
        for child in reversed(self._others):
            child.stop(30.0)
        self.http.close()
        self._log.close()
