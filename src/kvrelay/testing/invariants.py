"""The invariants a cluster must keep through any fault schedule: one checker for every fault test and the soak.

``check(records, snapshot)`` judges what the clients saw (``StreamRecord``s
of requests to the counting model, ``testing.counting_model``) and what the
cluster holds once quiet (``Snapshot``: the router's and the workers' status
views, the object tier's keys, the fact store's outcomes). It is pure: it
returns a ``Verdict`` whose ``violations`` are empty when every invariant
holds:

1. every request ended exactly once at its client: a stream ends with one
   ``finish_reason`` or one error event that says why, then one ``[DONE]``
   and nothing after it; an HTTP error has an error body with a message; a
   broken connection (the router died) is a clear end too, a stream silent
   past the client's read timeout is not (it is lost);
2. every delivered token came once, in order: the words a client read are the
   start of the counting model's continuation of its prompt, and a completed
   request has exactly ``max_tokens`` of them (usage says the same);
3. no stale attempt's token reached a client: it would show as a repeated or
   misplaced word (2.), and the router counts what it dropped as stale;
4. no reservation is left on any worker: no reservation, run, reserved or
   referenced page;
5. one outcome per request in the fact store, agreeing with what the client
   saw (finish reason, and the token count of a completed request), and the
   router counted at most one finish per request (at least one per request
   a client knows by its response id; an HTTP error body carries no id);
6. the router's residency index holds nothing a worker does not: each key it
   lists for a worker's gpu, ram or ssd tier that worker's status lists too,
   and each key it lists for the object tier is in the bucket; the router has
   no request in flight or queued.

A request whose router was killed under it may have no outcome (its router
died before it could record one), and so may one that ended at most
``OUTCOME_LINGER_S`` before its router was killed (the fact store sends what it
buffered every 0.2 s, and a ``kill -9`` loses what it had not sent); every
other routed request must have one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from kvrelay.testing.counting_model import expected_tokens, words_of
from kvrelay.testing.streams import StreamRecord

LOCAL_TIERS = ("gpu", "ram", "ssd")


class End(StrEnum):
    """How a request ended at its client."""

    COMPLETED = "completed"
    FAILED = "failed"
    """Ended with an error that says why (an HTTP error, an error event, a broken connection)."""
    LOST = "lost"
    """Never ended, or ended without a finish and without a clear error."""


OUTCOME_LINGER_S = 1.0
"""A request that ended this close before its router's ``kill -9`` may have no outcome (the fact store's 0.2-s
linger, then the writer's batch)."""


@dataclass(frozen=True)
class Outcome:
    """A request's row in the fact store's ``outcomes`` table."""

    finish_reason: str
    generated_tokens: int
    error: str | None


@dataclass
class Snapshot:
    """The cluster once quiet: status views (``launch.router.router_status``, ``launch.worker.worker_status``),
    the object tier's hex keys, the fact store's outcomes by request id, and the router's finish count over the
    schedule (None when the router restarted during it, which resets its counters)."""

    router: dict[str, Any]
    workers: dict[str, dict[str, Any]]
    object_keys: set[str]
    outcomes: dict[str, Outcome]
    finished: int | None = None
    router_restarted: bool = False
    router_killed_at: float | None = None
    """``time.monotonic()`` of the last ``kill -9`` of the router during the schedule, if any."""


@dataclass
class Verdict:
    ends: dict[int, End] = field(default_factory=dict)
    duplicated_tokens: int = 0
    misplaced_tokens: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    """The clear errors clients got, by message (ids and numbers left in)."""
    violations: list[str] = field(default_factory=list)

    def count(self, end: End) -> int:
        return sum(1 for e in self.ends.values() if e == end)


def classify(record: StreamRecord) -> tuple[End, list[str]]:
    """How ``record`` ended, and what broke invariant 1 in it."""
    n = record.index
    if record.ended_at is None:
        return End.LOST, [f"request {n} never ended"]
    if record.transport_error is not None:
        if "Timeout" in record.transport_error:
            return End.LOST, [f"request {n} went silent: {record.transport_error}"]
        return End.FAILED, []
    if record.status != 200:
        if not record.errors or not all(record.errors):
            return End.LOST, [f"request {n}: HTTP {record.status} without an error message"]
        return End.FAILED, []
    problems = []
    if record.done_markers != 1 or record.events_after_done:
        problems.append(f"request {n}: {record.done_markers} [DONE] markers, {record.events_after_done} events after")
    ends = len(record.finishes) + len(record.errors)
    if ends != 1:
        problems.append(f"request {n} ended {ends} times (finishes {record.finishes}, errors {record.errors})")
        return End.LOST, problems
    if record.errors:
        return End.FAILED, problems
    if record.finishes[0] not in ("length", "stop"):
        problems.append(f"request {n} finished '{record.finishes[0]}' without saying why")
        return End.LOST, problems
    return End.COMPLETED, problems


def check_tokens(record: StreamRecord, end: End, verdict: Verdict) -> None:
    """Invariants 2 and 3 for one record."""
    n = record.index
    try:
        seen = words_of(record.text)
    except ValueError as exc:
        verdict.violations.append(f"request {n}: garbled text: {exc}")
        return
    expected = expected_tokens(record.prompt, record.max_tokens)
    verdict.duplicated_tokens += len(seen) - len(set(seen))
    wrong = next((i for i, (a, b) in enumerate(zip(seen, expected, strict=False)) if a != b), None)
    if wrong is not None or len(seen) > len(expected):
        at = wrong if wrong is not None else len(expected)
        verdict.misplaced_tokens += len(seen) - at
        verdict.violations.append(f"request {n}: token {at} of {len(seen)} is not the continuation's (stale or dup)")
    if end == End.COMPLETED:
        usage = (record.usage or {}).get("completion_tokens")
        if len(seen) != record.max_tokens or usage != record.max_tokens:
            verdict.violations.append(
                f"request {n}: completed with {len(seen)} tokens (usage {usage}), {record.max_tokens} asked"
            )


def check_outcomes(records: Sequence[StreamRecord], verdict: Verdict, snapshot: Snapshot) -> None:
    """Invariant 5."""
    routed = 0
    for record in records:
        rid = record.request_id
        if rid is None:
            continue
        routed += 1
        outcome = snapshot.outcomes.get(rid)
        end = verdict.ends[record.index]
        if outcome is None:
            if not (record.transport_error and snapshot.router_restarted) and not _ended_as_router_died(
                record, snapshot
            ):
                verdict.violations.append(f"request {record.index} ({rid}) has no outcome in the fact store")
            continue
        want = {End.COMPLETED: record.finishes[:1], End.FAILED: ["error"]}.get(end)
        if record.transport_error is None and want is not None and [outcome.finish_reason] != want:
            verdict.violations.append(
                f"request {record.index} ({rid}): fact store says '{outcome.finish_reason}', client saw {end}"
            )
        if end == End.COMPLETED and outcome.generated_tokens != record.max_tokens:
            verdict.violations.append(
                f"request {record.index} ({rid}): fact store counts {outcome.generated_tokens} tokens"
            )
    if snapshot.finished is not None and not routed <= snapshot.finished <= len(records):
        verdict.violations.append(
            f"the router finished {snapshot.finished} requests; {len(records)} were sent, {routed} known by id"
        )


def _ended_as_router_died(record: StreamRecord, snapshot: Snapshot) -> bool:
    killed, ended = snapshot.router_killed_at, record.ended_at
    return killed is not None and ended is not None and killed - ended <= OUTCOME_LINGER_S


def check_cluster(snapshot: Snapshot, verdict: Verdict) -> None:
    """Invariants 4 and 6."""
    router = snapshot.router
    if router.get("requests") or router.get("queued"):
        verdict.violations.append(f"the router still holds requests {router['requests']} (queued {router['queued']})")
    for wid, status in sorted(snapshot.workers.items()):
        pages = status.get("pages", {"reserved": 0, "referenced": 0})  # a vLLM worker shows no page pool
        if status["reservations"] or status["runs"] or pages["reserved"] or pages["referenced"]:
            verdict.violations.append(
                f"worker {wid} is not quiet: {status['reservations']} reservations, {status['runs']} runs, "
                f"{pages['reserved']} reserved and {pages['referenced']} referenced pages"
            )
    index = router["index"]
    for wid, tiers in sorted(index["workers"].items()):
        held = snapshot.workers.get(wid)
        for tier in LOCAL_TIERS:
            listed = set(tiers.get(tier, ()))
            if not listed:
                continue
            if held is None:
                verdict.violations.append(f"the router's index lists {len(listed)} {tier} keys of {wid}, not live")
                continue
            extra = listed - set(held.get("keys", {}).get(tier, ()))
            if extra:
                verdict.violations.append(
                    f"the router's index lists {len(extra)} {tier} keys {wid} does not hold, e.g. {min(extra)}"
                )
    extra = set(index["object"]) - snapshot.object_keys
    if extra:
        verdict.violations.append(f"the router's index lists {len(extra)} object keys not in the bucket")


def cluster_violations(records: Sequence[StreamRecord], snapshot: Snapshot) -> list[str]:
    """Only the invariants the cluster may still be settling (4 to 6): retake a snapshot while these fail."""
    verdict = Verdict(ends={r.index: classify(r)[0] for r in records})
    check_outcomes(records, verdict, snapshot)
    check_cluster(snapshot, verdict)
    return verdict.violations


def check(records: Sequence[StreamRecord], snapshot: Snapshot) -> Verdict:
    """Every invariant of the module docstring over one fault schedule."""
    verdict = Verdict()
    for record in records:
        end, problems = classify(record)
        verdict.ends[record.index] = end
        verdict.violations.extend(problems)
        if end == End.FAILED:
            verdict.errors.update(record.errors or [record.transport_error or "?"])
        check_tokens(record, end, verdict)
    check_outcomes(records, verdict, snapshot)
    check_cluster(snapshot, verdict)
    return verdict
