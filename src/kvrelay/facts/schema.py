"""Tables of the fact store (SQLAlchemy Core), the same on SQLite and PostgreSQL.

Facts are decision-grade and low-rate: models, worker lifetimes, chunk lineage,
durable replica placement, routing decisions and measured outcomes. High-rate
samples (heartbeats, residency of the gpu and ram tiers) never come here.

Conventions every table keeps:
- chunk keys and model fingerprints are raw bytes (``LargeBinary``): keys are
  the 16-byte blake2b digests of docs/design.md section 4;
- times are float seconds on the clock of whoever recorded the fact (wall time
  for live processes, logical time under ``sim``);
- there are no foreign keys: facts arrive out of order (a replica may be
  recorded before its lineage), and each table is readable on its own.

Indexes serve the routing-path reads (live replicas by key, lineage by key)
and ``kvrelay explain`` (decisions and outcomes by request).
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB

metadata = sa.MetaData()

Json = sa.JSON().with_variant(JSONB(), "postgresql")
"""JSON documents: ``jsonb`` on PostgreSQL, JSON text on SQLite."""

Key = sa.LargeBinary(16)

models = sa.Table(
    "models",
    metadata,
    sa.Column("fingerprint", sa.LargeBinary, primary_key=True),
    sa.Column("name", sa.String(256), nullable=False),
    sa.Column("architecture", sa.String(128), nullable=False),
    sa.Column("source", sa.String(1024), nullable=False),
    sa.Column("recorded", sa.Float, nullable=False),
)

workers = sa.Table(
    "workers",
    metadata,
    sa.Column("worker_id", sa.String(256), primary_key=True),
    sa.Column("epoch", sa.BigInteger, primary_key=True),
    sa.Column("started", sa.Float, nullable=True),
    sa.Column("ended", sa.Float, nullable=True),
)

chunks = sa.Table(
    "chunks",
    metadata,
    sa.Column("key", Key, primary_key=True),
    sa.Column("parent", Key, nullable=True),
    sa.Column("model_fingerprint", sa.LargeBinary, nullable=False),
    sa.Column("position", sa.Integer, nullable=False),
)
"""Chunk lineage: ``key`` follows ``parent`` at ``position`` (1-based) under a model."""

replicas = sa.Table(
    "replicas",
    metadata,
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
    sa.Column("key", Key, nullable=False),
    sa.Column("tier", sa.String(16), nullable=False),
    sa.Column("location", sa.String(1024), nullable=False),
    sa.Column("bytes", sa.BigInteger, nullable=False),
    sa.Column("created", sa.Float, nullable=False),
    sa.Column("removed", sa.Float, nullable=True),
    sa.Column("reason", sa.String(256), nullable=True),
)
"""Replica placement; a row is live while ``removed`` is NULL. Removed rows stay as history."""

LIVE_REPLICA = replicas.c.removed.is_(None)

sa.Index(
    "ux_replicas_live",
    replicas.c.key,
    replicas.c.tier,
    replicas.c.location,
    unique=True,
    sqlite_where=LIVE_REPLICA,
    postgresql_where=LIVE_REPLICA,
)
"""At most one live replica of a key per (tier, location); also the index of the chain lookup."""

decisions = sa.Table(
    "decisions",
    metadata,
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
    sa.Column("request_id", sa.String(256), nullable=False),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("time", sa.Float, nullable=False),
    sa.Column("policy", sa.String(64), nullable=False),
    sa.Column("model", sa.String(256), nullable=False),
    sa.Column("chosen_worker", sa.String(256), nullable=True),
    sa.Column("predicted_ttft_s", sa.Float, nullable=True),
    sa.Column("terms", Json, nullable=True),
    sa.Column("chosen", Json, nullable=True),
    sa.Column("candidates", Json, nullable=False),
    sa.Column("excluded", Json, nullable=False),
    sa.Column("outcome", sa.String(32), nullable=False),
    sa.Column("outcome_reason", sa.String(256), nullable=True),
    sa.Column("outcome_time", sa.Float, nullable=True),
)
"""One row per scoring: an attempt re-scored after a decline has several rows, in ``id`` order.

``outcome`` is ``offered`` (or ``unroutable`` when nothing was chosen) until the
offer's fate arrives: ``accepted``, ``declined``, ``timed_out``, ``worker_lost``
or ``cancelled``, with ``outcome_reason``.
"""

sa.Index("ix_decisions_request", decisions.c.request_id, decisions.c.attempt, decisions.c.id)

outcomes = sa.Table(
    "outcomes",
    metadata,
    sa.Column("request_id", sa.String(256), primary_key=True),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("time", sa.Float, nullable=False),
    sa.Column("finish_reason", sa.String(32), nullable=False),
    sa.Column("ttft_s", sa.Float, nullable=True),
    sa.Column("itl_count", sa.Integer, nullable=False),
    sa.Column("itl_mean_s", sa.Float, nullable=True),
    sa.Column("itl_p50_s", sa.Float, nullable=True),
    sa.Column("itl_p99_s", sa.Float, nullable=True),
    sa.Column("itl_max_s", sa.Float, nullable=True),
    sa.Column("cached_tokens", Json, nullable=False),
    sa.Column("recomputed_tokens", sa.Integer, nullable=False),
    sa.Column("generated_tokens", sa.Integer, nullable=False),
    sa.Column("bytes_by_tier", Json, nullable=False),
    sa.Column("attempts", sa.Integer, nullable=False),
    sa.Column("error", sa.String(2048), nullable=True),
)
"""The measured outcome of a request (its last attempt); inter-token latency as a summary."""
