"""Reads of the fact store: chain facts for routing, decision history for ``explain``.

``FactReader.chain_facts(keys)`` fetches the lineage entries and the live
replicas of a chunk chain in one statement (a ``UNION ALL`` of both tables) per
``IN_LIST_KEYS`` keys: a chain of up to that many keys costs one round trip.
``replicas_for_chain`` and ``catalog_for_chain`` are its two halves, each one
statement too. Keys absent from the store are absent from the answers.
``event_replicas`` turns replicas into the triples ``RequestArrived.replicas``
carries to the pure router.
Database errors propagate; ``cache.ChainFactsCache`` is the routing-path face
that turns them into empty answers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from kvrelay.facts import schema
from kvrelay.protocol.messages import TIERS

IN_LIST_KEYS = 500
"""Keys bound per statement; longer chains are read in several statements."""


@dataclass(frozen=True, slots=True)
class Replica:
    """A live replica of ``key`` in ``tier`` at ``location`` (a worker id, or bucket/prefix)."""

    key: bytes
    tier: str
    location: str
    bytes: int
    created: float


@dataclass(frozen=True, slots=True)
class LineageEntry:
    """``key`` is the chunk at ``position`` (1-based) after ``parent`` under ``model_fingerprint``."""

    key: bytes
    parent: bytes | None
    model_fingerprint: bytes
    position: int


@dataclass(frozen=True, slots=True)
class ChainFacts:
    """What the store knows about a chain: lineage by key, live replicas by key."""

    catalog: dict[bytes, LineageEntry] = field(default_factory=dict)
    replicas: dict[bytes, list[Replica]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class DecisionRow:
    """One recorded scoring of one attempt (see ``schema.decisions``)."""

    id: int
    request_id: str
    attempt: int
    time: float
    policy: str
    model: str
    chosen_worker: str | None
    predicted_ttft_s: float | None
    terms: dict[str, Any] | None
    chosen: dict[str, Any] | None
    candidates: list[dict[str, Any]]
    excluded: dict[str, str]
    outcome: str
    outcome_reason: str | None
    outcome_time: float | None


@dataclass(frozen=True, slots=True)
class OutcomeRow:
    """The measured outcome of a request (see ``schema.outcomes``)."""

    request_id: str
    attempt: int
    time: float
    finish_reason: str
    ttft_s: float | None
    itl_count: int
    itl_mean_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    itl_max_s: float | None
    cached_tokens: dict[str, int]
    recomputed_tokens: int
    generated_tokens: int
    bytes_by_tier: dict[str, int]
    attempts: int
    error: str | None


@dataclass(frozen=True, slots=True)
class RequestHistory:
    """Every decision of a request in recording order, and its measured outcome when known."""

    request_id: str
    decisions: list[DecisionRow]
    outcome: OutcomeRow | None


def _null(type_: Any) -> Any:
    return sa.cast(sa.null(), type_)


def _chain_statement() -> sa.CompoundSelect[Any]:
    keys: sa.BindParameter[list[bytes]] = sa.bindparam("keys", expanding=True)
    c, r = schema.chunks, schema.replicas
    lineage = sa.select(
        sa.literal_column("'c'").label("kind"),
        c.c.key,
        c.c.parent,
        c.c.model_fingerprint,
        c.c.position,
        _null(sa.String).label("tier"),
        _null(sa.String).label("location"),
        _null(sa.BigInteger).label("bytes"),
        _null(sa.Float).label("created"),
    ).where(c.c.key.in_(keys))
    live = sa.select(
        sa.literal_column("'r'").label("kind"),
        r.c.key,
        _null(sa.LargeBinary).label("parent"),
        _null(sa.LargeBinary).label("model_fingerprint"),
        _null(sa.Integer).label("position"),
        r.c.tier,
        r.c.location,
        r.c.bytes,
        r.c.created,
    ).where(r.c.key.in_(keys), schema.LIVE_REPLICA)
    return sa.union_all(lineage, live)


CHAIN_FACTS = _chain_statement()
REPLICAS = sa.select(
    schema.replicas.c.key,
    schema.replicas.c.tier,
    schema.replicas.c.location,
    schema.replicas.c.bytes,
    schema.replicas.c.created,
).where(schema.replicas.c.key.in_(sa.bindparam("keys", expanding=True)), schema.LIVE_REPLICA)
CATALOG = sa.select(
    schema.chunks.c.key, schema.chunks.c.parent, schema.chunks.c.model_fingerprint, schema.chunks.c.position
).where(schema.chunks.c.key.in_(sa.bindparam("keys", expanding=True)))


def replica_order(replica: Replica) -> tuple[int, str]:
    """Sort key of a key's replicas: fastest tier first, then location (a deterministic order)."""
    return (TIERS.index(replica.tier) if replica.tier in TIERS else len(TIERS), replica.location)


def event_replicas(keys: Sequence[bytes], replicas: dict[bytes, list[Replica]]) -> tuple[tuple[bytes, str, str], ...]:
    """The ``(key, tier, location)`` triples of ``RequestArrived.replicas``, in chain order then replica order."""
    return tuple((r.key, r.tier, r.location) for key in dict.fromkeys(keys) for r in replicas.get(key, ()))


def _slices(keys: Sequence[bytes]) -> list[list[bytes]]:
    unique = list(dict.fromkeys(keys))
    return [unique[i : i + IN_LIST_KEYS] for i in range(0, len(unique), IN_LIST_KEYS)]


class FactReader:
    """Read-only queries over one engine; each method checks out one connection."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine

    def chain_facts(self, keys: Sequence[bytes]) -> ChainFacts:
        """Lineage and live replicas of ``keys``: one statement per ``IN_LIST_KEYS`` keys."""
        facts = ChainFacts()
        if not keys:
            return facts
        with self.engine.connect() as conn:
            for part in _slices(keys):
                for kind, key, parent, fingerprint, position, tier, location, size, created in conn.execute(
                    CHAIN_FACTS, {"keys": part}
                ).all():
                    if kind == "c":
                        facts.catalog[key] = LineageEntry(key, parent, fingerprint, position)
                    else:
                        facts.replicas.setdefault(key, []).append(Replica(key, tier, location, size, created))
        for found in facts.replicas.values():
            found.sort(key=replica_order)
        return facts

    def replicas_for_chain(self, keys: Sequence[bytes]) -> dict[bytes, list[Replica]]:
        """Live replicas of ``keys``, by key, each list in ``replica_order``."""
        found: dict[bytes, list[Replica]] = {}
        if not keys:
            return found
        with self.engine.connect() as conn:
            for part in _slices(keys):
                for row in conn.execute(REPLICAS, {"keys": part}):
                    found.setdefault(row.key, []).append(Replica(*row))
        for replicas in found.values():
            replicas.sort(key=replica_order)
        return found

    def catalog_for_chain(self, keys: Sequence[bytes]) -> dict[bytes, LineageEntry]:
        """Lineage entries of ``keys``, by key."""
        found: dict[bytes, LineageEntry] = {}
        if not keys:
            return found
        with self.engine.connect() as conn:
            for part in _slices(keys):
                for row in conn.execute(CATALOG, {"keys": part}):
                    found[row.key] = LineageEntry(*row)
        return found

    def request_history(self, request_id: str) -> RequestHistory | None:
        """Decisions (by attempt, then recording order) and outcome of a request; None if it has neither."""
        d, o = schema.decisions, schema.outcomes
        with self.engine.connect() as conn:
            decision_rows = conn.execute(
                sa.select(d).where(d.c.request_id == request_id).order_by(d.c.attempt, d.c.id)
            ).all()
            outcome_row = conn.execute(sa.select(o).where(o.c.request_id == request_id)).first()
        if not decision_rows and outcome_row is None:
            return None
        return RequestHistory(
            request_id=request_id,
            decisions=[DecisionRow(**row._mapping) for row in decision_rows],
            outcome=OutcomeRow(**outcome_row._mapping) if outcome_row is not None else None,
        )
