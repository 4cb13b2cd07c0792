"""How the writer turns one batch's validated writes into statements (pure).

``fold_offer_outcomes`` folds each offer outcome into the insert of the
decision it answers when that decision is in the same batch, before it in
recording order: the earliest such decision of the outcome's (request,
attempt, worker) still ``offered``, else the latest one ``accepted`` (the
rule of the ``offer_outcome`` UPDATE in ``statements``, applied in memory).
An outcome whose decision is not in the batch stays an UPDATE. The router
records a decision and then its offer's fate within milliseconds, so in a
steady stream nearly every decision costs one insert and no update.

``plan_groups`` orders what is left for ``executemany``: lanes in
``records.OPS`` order (decisions are inserted before the batch's remaining
updates run), order kept within a lane.
"""

from __future__ import annotations

from typing import Any

from kvrelay.facts.records import OPS, Write
from kvrelay.facts.statements import CONFLICT_KEYS

IndexedWrite = tuple[int, Write]
"""A write and the position of the buffered item it came from."""


def fold_offer_outcomes(writes: list[IndexedWrite]) -> list[IndexedWrite]:
    """``writes`` with every offer outcome whose decision precedes it in the batch folded into that decision.

    Only decision and offer-outcome writes change; every other write keeps its place.
    """
    out: list[IndexedWrite] = []
    decisions: dict[tuple[Any, Any, Any], list[int]] = {}
    for index, write in writes:
        params = write.params
        if write.op == "decision" and params["chosen_worker"] is not None:
            key = (params["request_id"], params["attempt"], params["chosen_worker"])
            decisions.setdefault(key, []).append(len(out))
        elif write.op == "offer_outcome":
            slots = decisions.get((params["p_request_id"], params["p_attempt"], params["p_worker_id"]), ())
            target = next((i for i in slots if out[i][1].params["outcome"] == "offered"), None)
            if target is None:
                target = next((i for i in reversed(slots) if out[i][1].params["outcome"] == "accepted"), None)
            if target is not None:
                answered = out[target]
                folded = {
                    "outcome": params["p_outcome"],
                    "outcome_reason": params["p_reason"],
                    "outcome_time": params["p_time"],
                }
                out[target] = (answered[0], Write("decision", {**answered[1].params, **folded}))
                continue
        out.append((index, write))
    return out


def plan_groups(writes: list[IndexedWrite]) -> list[tuple[str, list[IndexedWrite]]]:
    """Group a batch's writes for ``executemany``: lanes in ``OPS`` order, order kept within a lane.

    Replica stores and removals share one lane, so a store, removal and re-store
    of one replica keep their order. A new group starts whenever the operation
    changes or an upsert's conflict key repeats within the group.
    """
    lane = {op: i for i, op in enumerate(OPS)}
    lane["replica_removed"] = lane["replica_stored"]
    ordered = sorted(writes, key=lambda iw: lane[iw[1].op])
    groups: list[tuple[str, list[IndexedWrite]]] = []
    seen: set[tuple[Any, ...]] = set()
    for item in ordered:
        op = item[1].op
        conflict = CONFLICT_KEYS.get(op)
        key = tuple(item[1].params[k] for k in conflict) if conflict else None
        if not groups or groups[-1][0] != op or (key is not None and key in seen):
            groups.append((op, []))
            seen = set()
        groups[-1][1].append(item)
        if key is not None:
            seen.add(key)
    return groups
