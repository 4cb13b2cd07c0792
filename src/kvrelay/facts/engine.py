"""Engines for the fact store: a SQLite file by default, PostgreSQL by URL.

``make_engine(url)`` returns a lazy engine (it connects on first use). SQLite
connections run in WAL mode with ``synchronous=NORMAL`` and a busy timeout,
set by a connect event, so the writer process and routing-path readers do not
block each other. ``synchronous=NORMAL`` in WAL mode (SQLite's documented
choice for WAL): a commit appends to the write-ahead log without an fsync, and
the log is fsynced at each checkpoint. Every commit is atomic and the file
never corrupts; a committed transaction survives a crash of the writer or of
any other process, and only an operating-system crash or a power loss may roll
back the transactions committed since the last checkpoint (``FULL`` would fsync
every commit). JSON columns are decoded (and, for writes through SQLAlchemy,
encoded) with ``msgspec``, several times faster than the standard library on
decision snapshots. PostgreSQL URLs use psycopg 3
(``postgresql+psycopg://user@host:port/db``) with a connect timeout. There is
no pre-ping (it would double the round trips of a routing-path read): a
connection that a restarted server dropped fails once, is discarded, and the
writer's retry or the cache's next read window reconnects.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import sqlalchemy as sa

from kvrelay import paths
from kvrelay.facts import schema
from kvrelay.facts.statements import SUPPORTED_DIALECTS

FACTS_FILE = "facts.sqlite3"


def default_url() -> str:
    """``sqlite:///<data dir>/facts.sqlite3`` (see ``kvrelay.paths.data_dir``)."""
    return f"sqlite:///{paths.data_dir() / FACTS_FILE}"


def _json_text(value: Any) -> str:
    return msgspec.json.encode(value).decode()


def _sqlite_pragmas(busy_timeout_ms: int) -> Any:
    def on_connect(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
        finally:
            cursor.close()

    return on_connect


def make_engine(url: str, *, connect_timeout_s: float = 2.0) -> sa.Engine:
    """A lazy engine for ``url``; raises ``ValueError`` for a dialect other than SQLite or PostgreSQL."""
    parsed = sa.make_url(url)
    dialect = parsed.get_dialect().name
    if dialect not in SUPPORTED_DIALECTS:
        raise ValueError(
            f"fact store URL {parsed.render_as_string(hide_password=True)!r} is not SQLite or PostgreSQL; "
            "use sqlite:///PATH or postgresql+psycopg://USER@HOST:PORT/DB"
        )
    json_codec = {"json_serializer": _json_text, "json_deserializer": msgspec.json.decode}
    if dialect == "sqlite":
        engine = sa.create_engine(parsed, connect_args={"timeout": connect_timeout_s}, **json_codec)
        sa.event.listen(engine, "connect", _sqlite_pragmas(int(connect_timeout_s * 1000)))
        return engine
    return sa.create_engine(parsed, connect_args={"connect_timeout": max(1, round(connect_timeout_s))}, **json_codec)


def sqlite_path(engine: sa.Engine) -> Path | None:
    """The database file of a SQLite file engine; None for PostgreSQL or in-memory SQLite."""
    if engine.dialect.name != "sqlite":
        return None
    database = engine.url.database
    return Path(database) if database and database != ":memory:" else None


def create_schema(engine: sa.Engine) -> None:
    """Create missing tables and indexes (and a SQLite file's directory); existing ones are kept."""
    path = sqlite_path(engine)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
    schema.metadata.create_all(engine)
