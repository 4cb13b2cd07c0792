"""The write statement of each operation in ``records.OPS``, for one SQL dialect.

``build_statements`` defines them in SQLAlchemy Core; ``driver_statements``
compiles them once into the driver's SQL text with named parameters, which the
writer runs with the driver's own ``executemany`` over the parameter dicts of a
group of ``Write``s of the same operation (``Connection.exec_driver_sql``: no
per-row work in SQLAlchemy, errors still wrapped as ``sqlalchemy.exc``; the
parameters are driver-ready, JSON already text). Insert statements bind every
column but an autoincrement ``id`` (and a replica's ``removed`` and ``reason``),
and return nothing. Inserts are idempotent where a fact may arrive twice
(lineage, live replicas) and upserts where a later fact completes an earlier
one (models, worker start and end, a request's measured outcome).
``CONFLICT_KEYS`` names, per upsert, the parameters that must be unique within
one ``executemany`` (PostgreSQL refuses to update one row twice in a statement).

An offer outcome updates the decision it answers: the earliest decision of
that (request, attempt) chosen for that worker still ``offered``; if none is
(a worker lost after it accepted), the latest one it ``accepted``. So the
outcome lands on the right row even when all of a batch's decisions are
inserted before its offer outcomes. (Most outcomes never run this UPDATE: the
writer folds an outcome into its decision's insert when both are in one batch,
by the same rule; see ``batch_plan``.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.dialects.postgresql import psycopg
from sqlalchemy.dialects.sqlite import pysqlite

from kvrelay.facts import schema

SUPPORTED_DIALECTS = ("sqlite", "postgresql")

CONFLICT_KEYS: dict[str, tuple[str, ...]] = {
    "model": ("fingerprint",),
    "worker": ("worker_id", "epoch"),
    "outcome": ("request_id",),
}


def _insert(dialect: str, table: sa.Table) -> Any:
    if dialect == "sqlite":
        return sqlite.insert(table)
    if dialect == "postgresql":
        return postgresql.insert(table)
    raise ValueError(f"the fact store supports {', '.join(SUPPORTED_DIALECTS)}; got a {dialect!r} URL")


def _decision_for_offer(outcome: str, pick: Any) -> sa.ScalarSelect[Any]:
    d = schema.decisions.alias("answered")
    outcome_text: sa.ColumnElement[str] = sa.literal_column(f"'{outcome}'")
    return (
        sa.select(pick(d.c.id))
        .where(
            d.c.request_id == sa.bindparam("p_request_id"),
            d.c.attempt == sa.bindparam("p_attempt"),
            d.c.chosen_worker == sa.bindparam("p_worker_id"),
            d.c.outcome == outcome_text,
        )
        .scalar_subquery()
    )


def build_statements(dialect: str) -> dict[str, Any]:
    """Map every operation of ``records.OPS`` to its statement for ``dialect``."""
    models = _insert(dialect, schema.models)
    workers = _insert(dialect, schema.workers)
    outcomes = _insert(dialect, schema.outcomes)
    replicas = schema.replicas
    decisions = schema.decisions
    return {
        "model": models.on_conflict_do_update(
            index_elements=[schema.models.c.fingerprint],
            set_={c: models.excluded[c] for c in ("name", "architecture", "source", "recorded")},
        ),
        "worker": workers.on_conflict_do_update(
            index_elements=[schema.workers.c.worker_id, schema.workers.c.epoch],
            set_={
                "started": sa.func.coalesce(workers.excluded.started, schema.workers.c.started),
                "ended": sa.func.coalesce(workers.excluded.ended, schema.workers.c.ended),
            },
        ),
        "lineage": _insert(dialect, schema.chunks).on_conflict_do_nothing(index_elements=[schema.chunks.c.key]),
        "replica_stored": _insert(dialect, replicas).on_conflict_do_nothing(
            index_elements=[replicas.c.key, replicas.c.tier, replicas.c.location],
            index_where=schema.LIVE_REPLICA,
        ),
        "replica_removed": replicas.update()
        .where(
            replicas.c.key == sa.bindparam("p_key"),
            replicas.c.tier == sa.bindparam("p_tier"),
            replicas.c.location == sa.bindparam("p_location"),
            schema.LIVE_REPLICA,
        )
        .values(removed=sa.bindparam("p_time"), reason=sa.bindparam("p_reason")),
        "decision": decisions.insert(),
        "offer_outcome": decisions.update()
        .where(
            decisions.c.id
            == sa.func.coalesce(
                _decision_for_offer("offered", sa.func.min),
                _decision_for_offer("accepted", sa.func.max),
            )
        )
        .values(
            outcome=sa.bindparam("p_outcome"),
            outcome_reason=sa.bindparam("p_reason"),
            outcome_time=sa.bindparam("p_time"),
        ),
        "outcome": outcomes.on_conflict_do_update(
            index_elements=[schema.outcomes.c.request_id],
            set_={c.name: outcomes.excluded[c.name] for c in schema.outcomes.c if c.name != "request_id"},
        ),
    }


_DRIVER_DIALECTS: dict[str, Callable[[], sa.Dialect]] = {
    "sqlite": lambda: pysqlite.dialect(paramstyle="named"),
    "postgresql": psycopg.dialect,
}
"""Compilers with named parameters (``:name`` for sqlite3, ``%(name)s`` with casts for psycopg)."""

_INSERTED = {
    "model": schema.models,
    "worker": schema.workers,
    "lineage": schema.chunks,
    "replica_stored": schema.replicas,
    "decision": schema.decisions,
    "outcome": schema.outcomes,
}
_NOT_INSERTED = {"replica_stored": ("removed", "reason")}
"""Columns an insert leaves NULL besides ``id``: a stored replica is live."""


def insert_columns(op: str) -> list[str]:
    """The parameters of an insert operation: its table's columns but ``id`` and those in ``_NOT_INSERTED``."""
    skipped = ("id", *_NOT_INSERTED.get(op, ()))
    return [c.name for c in _INSERTED[op].c if c.name not in skipped]


def driver_statements(dialect: str) -> dict[str, str]:
    """Every operation's statement as the driver's SQL text (named parameters, no literal binds left)."""
    if dialect not in _DRIVER_DIALECTS:
        raise ValueError(f"the fact store supports {', '.join(SUPPORTED_DIALECTS)}; got a {dialect!r} URL")
    compiler = _DRIVER_DIALECTS[dialect]()
    out: dict[str, str] = {}
    for op, statement in build_statements(dialect).items():
        if op in _INSERTED:
            compiled = statement.inline().compile(dialect=compiler, column_keys=insert_columns(op))
        else:
            compiled = statement.compile(dialect=compiler)
        if not all(bind.required or bind.value is None for bind in compiled.binds.values()):
            raise AssertionError(f"the {op} statement binds a literal; write it as SQL text")
        out[op] = compiled.string
    return out
