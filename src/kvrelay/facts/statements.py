"""The write statement of each operation in ``records.OPS``, for one SQL dialect.

Each statement runs with ``executemany`` over the parameter dicts of a group
of ``Write``s of the same operation. Inserts are idempotent where a fact may
arrive twice (lineage, live replicas) and upserts where a later fact completes
an earlier one (models, worker start and end, a request's measured outcome).
``CONFLICT_KEYS`` names, per upsert, the parameters that must be unique within
one ``executemany`` (PostgreSQL refuses to update one row twice in a statement).

An offer outcome updates the decision it answers: the earliest decision of
that (request, attempt) chosen for that worker still ``offered``; if none is
(a worker lost after it accepted), the latest one it ``accepted``. So the
outcome lands on the right row even when all of a batch's decisions are
inserted before its offer outcomes.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

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
    return (
        sa.select(pick(d.c.id))
        .where(
            d.c.request_id == sa.bindparam("p_request_id"),
            d.c.attempt == sa.bindparam("p_attempt"),
            d.c.chosen_worker == sa.bindparam("p_worker_id"),
            d.c.outcome == outcome,
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
