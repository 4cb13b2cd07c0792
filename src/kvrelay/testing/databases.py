"""Real databases for fact-store tests: a SQLite file, and a PostgreSQL schema of its own.

``postgres_schema_url`` gives a fresh schema on the server named by
``KVRELAY_TEST_PG_URL``, dropped afterwards, so concurrent runs never see each
other's rows; the tests' ``fact_db_url`` fixture (``tests/support/fixtures.py``)
is built on it, and ``closed_port_pg_url`` serves failure tests.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import sqlalchemy as sa

PG_ENV = "KVRELAY_TEST_PG_URL"
ENABLE_PG = (
    f"set {PG_ENV} to run the PostgreSQL variant: export {PG_ENV}=$(bash scripts/start_postgres.sh) (.ci/run does this)"
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
