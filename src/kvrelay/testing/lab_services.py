"""The services of a lab cluster, each on its own host: PostgreSQL (the fact store) and S3 (``moto_server``).

``start_postgres(host)`` makes a throwaway PostgreSQL 15 cluster (``initdb``
as the ``postgres`` user, as ``scripts/start_postgres.sh`` does) in a fresh
directory, lets the lab's subnet connect without a password, and runs
``postgres`` in ``host`` listening on the host's address; ``start_moto(host)``
runs ``moto_server`` there and makes the bucket. Each returns a ``Service``
whose ``url`` the lab's other hosts use and whose ``close()`` stops it and
removes its files.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvrelay.launch.child import ChildProcess
from kvrelay.testing.moto import moto_server_command
from kvrelay.testing.netns import SUBNET, Host, sh

PG_BIN = Path("/usr/lib/postgresql/15/bin")
PG_PORT = 5432
S3_PORT = 5000
BUCKET = "kvrelay-lab"
S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
READY_S = 60.0


@dataclass
class Service:
    name: str
    child: ChildProcess
    url: str
    files: list[Path] = field(default_factory=list)

    def close(self) -> None:
        self.child.stop(15)
        for path in self.files:
            shutil.rmtree(path, ignore_errors=True)


def postgres_missing() -> str | None:
    """Why a lab cannot run PostgreSQL here, or None."""
    if not (PG_BIN / "initdb").is_file():
        return "PostgreSQL 15 is not installed: bash scripts/start_postgres.sh installs it (.ci/run runs it)"
    if sh("id", "postgres", check=False).returncode != 0:
        return "there is no 'postgres' user: bash scripts/start_postgres.sh makes it"
    return None


def start_postgres(host: Host) -> Service:
    """PostgreSQL on ``host``: database ``postgres``, user ``postgres``, no password from the lab's subnet."""
    missing = postgres_missing()
    if missing is not None:
        raise RuntimeError(missing)
    root = Path(tempfile.mkdtemp(prefix="kvlab-pg-"))
    root.chmod(0o755)
    data = root / "data"
    data.mkdir()
    for path in (root, data):
        shutil.chown(path, "postgres", "postgres")
    as_postgres = ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups"]
    sh(*as_postgres, str(PG_BIN / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", timeout=120)
    with open(data / "pg_hba.conf", "a") as hba:
        hba.write(f"host all all {SUBNET}.0/24 trust\n")
    argv = [*as_postgres, str(PG_BIN / "postgres"), "-D", str(data), "-p", str(PG_PORT), "-k", str(root)]
    argv += ["-c", f"listen_addresses={host.ip}", "-c", "fsync=off", "-c", "max_connections=200"]
    child = ChildProcess("postgres", host.argv(argv), dict(os.environ))
    service = Service("postgres", child, f"postgresql+psycopg://postgres@{host.ip}:{PG_PORT}/postgres", [root])
    try:
        child.wait_for("database system is ready to accept connections", READY_S)
    except Exception:
        service.close()
        raise
    return service


def start_moto(host: Host) -> Service:
    """``moto_server`` on ``host``, with the bucket ``BUCKET`` made."""
    argv = [moto_server_command(), "-H", host.ip, "-p", str(S3_PORT)]
    child = ChildProcess("moto_server", host.argv(argv), dict(os.environ, **S3_CREDENTIALS))
    url = f"http://{host.ip}:{S3_PORT}"
    service = Service("moto_server", child, url)
    try:
        host.call(lambda: _wait_answering(url, child))
        host.call(lambda: s3_client(url).create_bucket(Bucket=BUCKET))
    except Exception:
        service.close()
        raise
    return service


def _wait_answering(url: str, child: ChildProcess) -> None:
    deadline = time.monotonic() + READY_S
    while True:
        try:
            httpx.get(url, timeout=1.0)
            return
        except httpx.HTTPError:
            if child.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"moto_server did not answer on {url}; output:\n{child.tail()}") from None
            time.sleep(0.1)


def s3_client(url: str) -> Any:
    """A boto3 client of the lab's moto_server (call it on a thread inside a lab host)."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=url,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
