"""A request's history built from its router ``Record``s in memory: the rows the fact store would hold.

``history_from_records(request_id, records)`` returns the ``RequestHistory``
that ``FactReader.request_history`` would read once the store has written
``records`` (one request's ``decision``, ``offer_outcome`` and ``outcome``
records, in emission order): each record goes through the store's own
translation (``records.record_write``), its JSON columns are decoded as the
store decodes them, and an offer outcome lands on the decision the store's
update picks (the earliest still ``offered`` decision of that attempt and
worker, else the latest ``accepted`` one). So ``explain_lines`` of it is what
``kvrelay explain`` prints for the same request. Records the store would reject
are skipped. Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from typing import Any

from kvrelay.core.router.events import Record, RecordKind
from kvrelay.facts.queries import DecisionRow, OutcomeRow, RequestHistory
from kvrelay.facts.records import MalformedRecord, UnknownKind, record_write

_DECISION_JSON = ("terms", "chosen", "candidates", "excluded")
_OUTCOME_JSON = ("cached_tokens", "bytes_by_tier")


def _decoded(params: dict[str, Any], columns: tuple[str, ...]) -> dict[str, Any]:
    out = dict(params)
    for column in columns:
        text = out.get(column)
        out[column] = None if text is None else json.loads(text)
    return out


def _answered(decisions: list[DecisionRow], params: dict[str, Any]) -> int | None:
    """Index of the decision an offer outcome updates (the store's ``offer_outcome`` statement), or None."""

    def matching(outcome: str) -> list[int]:
        return [
            i
            for i, d in enumerate(decisions)
            if d.attempt == params["p_attempt"] and d.chosen_worker == params["p_worker_id"] and d.outcome == outcome
        ]

    offered, accepted = matching("offered"), matching("accepted")
    if offered:
        return offered[0]
    return accepted[-1] if accepted else None


def history_from_records(request_id: str, records: Iterable[Record]) -> RequestHistory | None:
    """The history of ``request_id`` from its records (see the module contract); None when none is usable."""
    decisions: list[DecisionRow] = []
    outcome: OutcomeRow | None = None
    for record in records:
        if record.request_id != request_id or record.kind == RecordKind.REPLICA:
            continue
        try:
            write = record_write(record)
        except (MalformedRecord, UnknownKind):
            continue
        if write.op == "decision":
            decisions.append(DecisionRow(id=len(decisions) + 1, **_decoded(write.params, _DECISION_JSON)))
        elif write.op == "offer_outcome":
            index = _answered(decisions, write.params)
            if index is not None:
                decisions[index] = dataclasses.replace(
                    decisions[index],
                    outcome=write.params["p_outcome"],
                    outcome_reason=write.params["p_reason"],
                    outcome_time=write.params["p_time"],
                )
        elif write.op == "outcome":
            outcome = OutcomeRow(**_decoded(write.params, _OUTCOME_JSON))
    if not decisions and outcome is None:
        return None
    decisions.sort(key=lambda d: (d.attempt, d.id))
    return RequestHistory(request_id=request_id, decisions=decisions, outcome=outcome)
