"""Real databases for fact-store tests: a SQLite file, and a PostgreSQL schema of its own.

``fact_db_url`` is a fixture parametrized over ``sqlite`` (a file under the
test's tmp_path) and ``postgresql`` (a fresh schema on the server named by
``KVRELAY_TEST_PG_URL``, dropped afterwards, so concurrent test runs never see
each other's rows). Without that variable the PostgreSQL variant skips and
says how to enable it. ``postgres_schema_url`` and ``closed_port_pg_url`` serve
benchmarks and failure tests.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import sqlalchemy as sa

PG_ENV = "KVRELAY_TEST_PG_URL"
ENABLE_PG = (
    f"set {PG_ENV} to run the PostgreSQL variant: export {PG_ENV}=$(bash scripts/start_postgres.sh) "
    "(.ci/run does this)"
)


def sqlite_file_url(directory: Path, name: str = "facts.sqlite3") -> str:
    return f"sqlite:///{directory / name}"


def pg_base_url() -> str | None:
    """The PostgreSQL URL from the environment, or None when it is unset or empty."""
    return os.environ.get(PG_ENV) or None


@contextmanager
def postgres_schema_url(base_url: str) -> Iterator[str]:
    """A URL whose connections use a fresh, empty schema of ``base_url``'s database; dropped on exit."""
    schema = f"kvrelay_t_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(base_url)
    try:
        with admin.begin() as conn:
            conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
        url = sa.make_url(base_url).update_query_dict({"options": f"-csearch_path={schema}"})
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.begin() as conn:
            conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()


def closed_port_pg_url() -> str:
    """A PostgreSQL URL on a loopback port nothing listens on (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"postgresql+psycopg://postgres@127.0.0.1:{port}/kvrelay_down"


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def fact_db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty fact-store database: a SQLite file, or a fresh PostgreSQL schema."""
    if request.param == "sqlite":
        yield sqlite_file_url(tmp_path)
        return
    base = pg_base_url()
    if base is None:
        pytest.skip(ENABLE_PG)
    with postgres_schema_url(base) as url:
        yield url
