"""Validation of incoming facts and their translation into row writes (pure).

Input is either a router ``Record`` effect (kinds ``decision``,
``offer_outcome``, ``outcome``) or a ``Fact`` built by ``FactStore``'s
``record_*`` methods. ``to_writes`` checks the shape of the data (unknown extra
keys are ignored; missing or mistyped fields, unknown tiers and non-finite
numbers are rejected; over-long free text is clipped) and returns its ``Write``s: an operation name from
``OPS`` and the parameters of its statement (see ``statements``), ready for
the driver: JSON columns as JSON text (``json_text``: msgspec structs as
objects, route segments as arrays; None stays SQL NULL). A decision's
parameters include its offer outcome (``offered``, or ``unroutable`` when
nothing was chosen) so that an outcome arriving in the same batch can be
folded into the insert (``batch_plan``). It raises
``UnknownKind`` for a kind it does not know and ``MalformedRecord`` for bad
data, each with a message naming the record and the offending field.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from kvrelay.core.router.events import OfferOutcome, Record
from kvrelay.protocol.chunk_keys import DIGEST_BYTES
from kvrelay.protocol.messages import FinishReason, RouteSegment, Tier

OPS: tuple[str, ...] = (
    "model",
    "worker",
    "lineage",
    "replica_stored",
    "replica_removed",
    "decision",
    "offer_outcome",
    "outcome",
)
"""Every write operation, in the order the writer applies a batch's lanes."""

# The validation structs below are built from plain data and never form reference cycles, so they are
# created with ``gc=False``: a decision's records then cost the collector nothing (docs/performance.md,
# "Records without the collector").

Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=1e11)]
"""A finite, non-negative duration or time; NaN and infinities are rejected."""
Count = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
"""A non-negative count that fits a BIGINT column."""
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
ChunkKey = Annotated[bytes, msgspec.Meta(min_length=DIGEST_BYTES, max_length=DIGEST_BYTES)]
Fingerprint = Annotated[bytes, msgspec.Meta(min_length=1, max_length=1024)]


class UnknownKind(ValueError):
    """A record or fact whose kind this store does not know."""


class MalformedRecord(ValueError):
    """A record or fact whose data does not have the documented shape."""


@dataclass(frozen=True, slots=True)
class Fact:
    """A non-``Record`` fact (model, worker, lineage, replica), validated by the writer."""

    kind: str
    params: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Write:
    """One row operation: ``op`` names the statement, ``params`` its bound values."""

    op: str
    params: dict[str, Any]


class Terms(msgspec.Struct, frozen=True, gc=False):
    queue_s: Seconds
    restore_s: dict[Tier, Seconds]
    prefill_s: Seconds
    decode_s: Seconds


class Candidate(msgspec.Struct, frozen=True, gc=False):
    worker_id: Name
    route: list[RouteSegment]
    cached_tokens: Count
    predicted_ttft_s: Seconds
    terms: Terms


class DecisionData(msgspec.Struct, frozen=True, gc=False):
    policy: Name
    model: Name
    chosen: Candidate | None
    candidates: list[Candidate]
    excluded: dict[Name, str]


class OfferOutcomeData(msgspec.Struct, frozen=True, gc=False):
    worker_id: Name
    outcome: OfferOutcome
    reason: str | None = None


class OutcomeData(msgspec.Struct, frozen=True, gc=False):
    finish_reason: FinishReason
    ttft_s: Seconds | None
    inter_token_s: list[Seconds]
    cached_tokens: dict[Tier, Count]
    recomputed_tokens: Count
    generated_tokens: Count
    bytes_by_tier: dict[Tier, Count]
    attempts: Annotated[int, msgspec.Meta(ge=0)]
    error: str | None = None


class RecordHeader(msgspec.Struct, frozen=True, gc=False):
    request_id: Name
    attempt: Annotated[int, msgspec.Meta(ge=1)]
    now: Seconds


class OutcomeHeader(msgspec.Struct, frozen=True, gc=False):
    """An outcome's header: ``attempt`` is 0 for a request that ended before its first offer (its client
    left while it was being routed or waited in the router queue, or the queue refused it)."""

    request_id: Name
    attempt: Annotated[int, msgspec.Meta(ge=0)]
    now: Seconds


class ModelFact(msgspec.Struct, frozen=True, gc=False):
    fingerprint: Fingerprint
    name: Name
    architecture: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    source: str
    now: Seconds


class WorkerFact(msgspec.Struct, frozen=True, gc=False):
    worker_id: Name
    epoch: Count
    started: Seconds | None
    ended: Seconds | None


class LineageFact(msgspec.Struct, frozen=True, array_like=True, gc=False):
    key: ChunkKey
    parent: ChunkKey | None
    fingerprint: Fingerprint
    position: Annotated[int, msgspec.Meta(ge=1)]


class LineageBatch(msgspec.Struct, frozen=True, gc=False):
    entries: list[LineageFact]


class ReplicaStoredFact(msgspec.Struct, frozen=True, gc=False):
    key: ChunkKey
    tier: Tier
    location: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
    bytes: Count
    now: Seconds


class ReplicaChangesFact(msgspec.Struct, frozen=True, gc=False):
    tier: Tier
    location: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
    stored: list[ChunkKey]
    removed: list[ChunkKey]
    reason: str
    bytes: Count
    now: Seconds


class ReplicaRemovedFact(msgspec.Struct, frozen=True, gc=False):
    key: ChunkKey
    tier: Tier
    location: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
    reason: str
    now: Seconds


REASON_CHARS = 256
ERROR_CHARS = 2048
SOURCE_CHARS = 1024
"""Free text (reasons, errors, sources) is clipped to these lengths, never rejected for its length."""


_json_encode = msgspec.json.Encoder().encode


def json_text(value: Any) -> str | None:
    """``value`` as JSON text for a JSON column (None stays None: SQL NULL)."""
    return None if value is None else _json_encode(value).decode()


def clip(text: str | None, limit: int) -> str | None:
    """``text`` cut to ``limit`` characters, the cut marked with an ellipsis."""
    if text is None or len(text) <= limit:
        return text
    return text[: limit - 1] + "\u2026"


def _convert(value: Any, kind: type, what: str) -> Any:
    try:
        return msgspec.convert(value, kind, from_attributes=True)
    except msgspec.ValidationError as exc:
        raise MalformedRecord(f"{what}: {exc}; expected the shape documented in kvrelay.facts.records") from None


def _nearest_rank(ordered: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of a non-empty ascending list."""
    rank = max(1, -(-len(ordered) * q // 1))
    return ordered[int(rank) - 1]


def inter_token_summary(samples: list[float]) -> dict[str, Any]:
    """Count, mean, p50, p99 and max of inter-token gaps (all None but the count when empty)."""
    if not samples:
        return {"itl_count": 0, "itl_mean_s": None, "itl_p50_s": None, "itl_p99_s": None, "itl_max_s": None}
    ordered = sorted(samples)
    return {
        "itl_count": len(ordered),
        "itl_mean_s": sum(ordered) / len(ordered),
        "itl_p50_s": _nearest_rank(ordered, 0.5),
        "itl_p99_s": _nearest_rank(ordered, 0.99),
        "itl_max_s": ordered[-1],
    }


def materialize(candidate: Any) -> Any:
    """A lazy candidate (an object whose ``best`` attribute is the candidate, like the router's
    ``WorkerRoute``) becomes that candidate; anything else is returned as it is."""
    if isinstance(candidate, dict):
        return candidate
    best = getattr(candidate, "best", None)
    return candidate if best is None else best


def _decision_input(data: dict[str, Any], what: str) -> dict[str, Any]:
    """``data`` with lazy candidates materialized (off the routing path, in the writer)."""
    try:
        out = dict(data)
        if "chosen" in data:
            out["chosen"] = materialize(data["chosen"])
        if isinstance(data.get("candidates"), (list, tuple)):
            out["candidates"] = [materialize(c) for c in data["candidates"]]
        return out
    except Exception as exc:
        raise MalformedRecord(f"{what}: a lazy candidate failed to materialize: {exc!r}") from None


def _decision_write(head: RecordHeader, data: DecisionData) -> Write:
    chosen = data.chosen
    return Write(
        "decision",
        {
            "request_id": head.request_id,
            "attempt": head.attempt,
            "time": head.now,
            "policy": data.policy,
            "model": data.model,
            "chosen_worker": chosen.worker_id if chosen else None,
            "predicted_ttft_s": chosen.predicted_ttft_s if chosen else None,
            "terms": json_text(chosen.terms) if chosen else None,
            "chosen": json_text(chosen),
            "candidates": json_text(data.candidates),
            "excluded": json_text({worker: clip(reason, ERROR_CHARS) for worker, reason in data.excluded.items()}),
            "outcome": "offered" if chosen else "unroutable",
            "outcome_reason": None,
            "outcome_time": None,
        },
    )


def _offer_outcome_write(head: RecordHeader, data: OfferOutcomeData) -> Write:
    return Write(
        "offer_outcome",
        {
            "p_request_id": head.request_id,
            "p_attempt": head.attempt,
            "p_worker_id": data.worker_id,
            "p_outcome": data.outcome,
            "p_reason": clip(data.reason, REASON_CHARS),
            "p_time": head.now,
        },
    )


def _outcome_write(head: OutcomeHeader, data: OutcomeData) -> Write:
    return Write(
        "outcome",
        {
            "request_id": head.request_id,
            "attempt": head.attempt,
            "time": head.now,
            "finish_reason": data.finish_reason,
            "ttft_s": data.ttft_s,
            **inter_token_summary(data.inter_token_s),
            "cached_tokens": json_text(data.cached_tokens),
            "recomputed_tokens": data.recomputed_tokens,
            "generated_tokens": data.generated_tokens,
            "bytes_by_tier": json_text(data.bytes_by_tier),
            "attempts": data.attempts,
            "error": clip(data.error, ERROR_CHARS),
        },
    )


RECORD_KINDS: dict[str, tuple[type, Callable[[Any, Any], Write]]] = {
    "decision": (DecisionData, _decision_write),
    "offer_outcome": (OfferOutcomeData, _offer_outcome_write),
    "outcome": (OutcomeData, _outcome_write),
}


def record_write(record: Record) -> Write:
    """The write for a router ``Record``; raises ``UnknownKind`` or ``MalformedRecord``."""
    if not isinstance(record, Record):
        raise MalformedRecord(f"expected a kvrelay.core.router.events.Record, got {type(record).__name__}")
    if record.kind not in RECORD_KINDS:
        raise UnknownKind(f"record kind {record.kind!r} is not stored; stored kinds: {', '.join(RECORD_KINDS)}")
    what = f"{record.kind} record ({record.request_id!r}, attempt {record.attempt!r})"
    header_type = OutcomeHeader if record.kind == "outcome" else RecordHeader
    head = _convert({"request_id": record.request_id, "attempt": record.attempt, "now": record.now}, header_type, what)
    data_type, build = RECORD_KINDS[record.kind]
    if not isinstance(record.data, dict):
        raise MalformedRecord(f"{what}: data must be a dict, got {type(record.data).__name__}")
    data = _decision_input(record.data, what) if record.kind == "decision" else record.data
    return build(head, _convert(data, data_type, what))


def fact_writes(fact: Fact) -> list[Write]:
    """The writes for a ``Fact`` (one per lineage entry, one per key of replica changes: stores, then
    removals); raises ``UnknownKind`` or ``MalformedRecord``."""
    what = f"{fact.kind} fact"
    if fact.kind == "model":
        m = _convert(fact.params, ModelFact, what)
        row = {"fingerprint": m.fingerprint, "name": m.name, "architecture": m.architecture}
        return [Write("model", {**row, "source": clip(m.source, SOURCE_CHARS), "recorded": m.now})]
    if fact.kind == "worker":
        w = _convert(fact.params, WorkerFact, what)
        return [Write("worker", {"worker_id": w.worker_id, "epoch": w.epoch, "started": w.started, "ended": w.ended})]
    if fact.kind == "lineage":
        entries = _convert(fact.params, LineageBatch, what).entries
        return [
            Write(
                "lineage",
                {"key": e.key, "parent": e.parent, "model_fingerprint": e.fingerprint, "position": e.position},
            )
            for e in entries
        ]
    if fact.kind == "replica_stored":
        r = _convert(fact.params, ReplicaStoredFact, what)
        row = {"key": r.key, "tier": r.tier, "location": r.location, "bytes": r.bytes, "created": r.now}
        return [Write("replica_stored", row)]
    if fact.kind == "replica_removed":
        d = _convert(fact.params, ReplicaRemovedFact, what)
        where = {"p_key": d.key, "p_tier": d.tier, "p_location": d.location}
        return [Write("replica_removed", {**where, "p_reason": clip(d.reason, REASON_CHARS), "p_time": d.now})]
    if fact.kind == "replica_changes":
        c = _convert(fact.params, ReplicaChangesFact, what)
        stored = [
            {"key": k, "tier": c.tier, "location": c.location, "bytes": c.bytes, "created": c.now} for k in c.stored
        ]
        reason = clip(c.reason, REASON_CHARS)
        removed = [
            {"p_key": k, "p_tier": c.tier, "p_location": c.location, "p_reason": reason, "p_time": c.now}
            for k in c.removed
        ]
        return [Write("replica_stored", row) for row in stored] + [Write("replica_removed", row) for row in removed]
    raise UnknownKind(f"fact kind {fact.kind!r} is not stored; see FactStore.record_* for the stored facts")


def to_writes(item: Record | Fact) -> list[Write]:
    """Validate one buffered item and return its writes."""
    return fact_writes(item) if isinstance(item, Fact) else [record_write(item)]
