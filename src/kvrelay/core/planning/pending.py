"""Predict on route: chunks a routed request will leave on its worker's device, before they are resident.

A router that learns a prefix only from residency events learns it when the
worker registers it, after the prefill; followers sharing the prefix that
arrive during a long prefill then see no copy anywhere and spread by queue.
So when the router routes a request it credits the chosen worker with the
request's chain keys as *pending* (the ``PENDING`` mark of that worker in the
residency index): a follower's route on that worker reaches them, and the
worker re-matches its prefix when the follower's prefill starts
(docs/design.md section 6). A credit is advisory and conservative; it ends

- per key, when the worker reports the key stored on its device (``settle``);
- per request, when the attempt ends: finished, abandoned or re-routed (``release``);
- at its deadline (``expire``), the safety net for a lost result;
- with the worker (``drop_worker``), when its epoch ends.

Several requests may credit the same key on one worker; the mark stays until
the last of them ends. After a key was settled, a request that credited it
may release a later credit of the same key by another request: the router
then only under-estimates (the bound is on memory, the error on the safe side).
At most ``max_keys`` (worker, key) credits are held; a credit beyond that keeps
its chain's leading keys, which followers match first.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvrelay.core.planning.index import GPU, ResidencyIndex
from kvrelay.core.planning.routes import is_pending
from kvrelay.protocol.messages import RouteSegment

DEFAULT_MAX_PENDING_KEYS = 500_000


@dataclass(frozen=True, slots=True)
class Credit:
    """One request's credit: its keys pending on one worker until ``deadline``; ``priority`` is its offer's
    place in that worker's prefill queue (``Offer.priority``)."""

    worker_id: str
    keys: frozenset[bytes]
    deadline: float
    serial: int
    priority: float


class PendingCredits:
    """The pending credits of every live request, mirrored as ``PENDING`` marks in ``index``."""

    def __init__(self, index: ResidencyIndex, max_keys: int = DEFAULT_MAX_PENDING_KEYS) -> None:
        if max_keys < 0:
            raise ValueError(f"max_keys must be non-negative, got {max_keys}")
        self.index = index
        self.max_keys = max_keys
        self._credits: dict[str, Credit] = {}
        self._counts: dict[str, dict[bytes, int]] = {}
        """Worker -> key -> how many live credits hold it."""
        self._held = 0
        self._deadlines: list[tuple[float, int, str]] = []
        self._serial = 0
        self.truncated = 0
        """Keys not credited because the bound was reached."""

    def __len__(self) -> int:
        """(worker, key) credits held."""
        return self._held

    def pending_on(self, worker_id: str) -> dict[bytes, int]:
        """Key -> live credits, on one worker (read-only use)."""
        return self._counts.get(worker_id, {})

    def first_priority_on_route(
        self, worker_id: str, route: Sequence[RouteSegment], chain: Sequence[bytes]
    ) -> float | None:
        """``first_priority`` of the last pending chunk ``route`` counts as cached on ``worker_id`` (None: it
        counts none). An offer of that route must not take a lower priority: in the worker's queue it would pass
        the request computing its prefix, find nothing to reuse and compute it a second time."""
        if not route or not is_pending(route[-1]):  # nothing follows a pending segment (``routes.walk_route``)
            return None
        return self.first_priority(worker_id, chain[sum(s.chunks for s in route) - 1])

    def first_priority(self, worker_id: str, key: bytes) -> float | None:
        """The lowest offer priority of the credits on ``worker_id`` holding ``key``: the request that will
        compute it first there; None if no credit holds it."""
        return min(
            (c.priority for c in self._credits.values() if c.worker_id == worker_id and key in c.keys), default=None
        )

    def credit(
        self, worker_id: str, request_id: str, chain: Sequence[bytes], deadline: float, priority: float = 0.0
    ) -> int:
        """Credit ``worker_id`` with the keys of ``chain`` not already on its device, for an offer of ``priority``;
        replaces the request's earlier credit. Returns how many keys were credited."""
        self.release(request_id)
        shift = self.index.shift_of(worker_id)
        if shift is None:
            self.index.slot(worker_id)
            shift = self.index.shift_of(worker_id)
            assert shift is not None
        counts = self._counts.setdefault(worker_id, {})
        room = self.max_keys - self._held
        keys: list[bytes] = []
        fresh: list[bytes] = []
        for key in chain:
            if (self.index.value(key) >> shift) & GPU:
                continue
            n = counts.get(key, 0)
            if n == 0:
                if room <= 0:
                    self.truncated += 1
                    break
                room -= 1
                fresh.append(key)
            counts[key] = n + 1
            keys.append(key)
        if not keys:
            return 0
        self._held += len(fresh)
        if fresh:
            self.index.store(worker_id, "pending", fresh)
        self._serial += 1
        self._credits[request_id] = Credit(worker_id, frozenset(keys), deadline, self._serial, priority)
        heapq.heappush(self._deadlines, (deadline, self._serial, request_id))
        return len(keys)

    def release(self, request_id: str) -> int:
        """End the request's credit (its attempt ended or it was re-routed); returns the marks it ended."""
        credit = self._credits.pop(request_id, None)
        return 0 if credit is None else self._uncount(credit.worker_id, credit.keys)

    def settle(self, worker_id: str, keys: Iterable[bytes]) -> None:
        """``keys`` are now resident on ``worker_id``'s device: they are no longer pending there."""
        counts = self._counts.get(worker_id)
        if not counts:
            return
        done = [key for key in keys if counts.pop(key, 0)]
        if done:
            self._held -= len(done)
            self.index.remove(worker_id, "pending", done)

    def expire(self, now: float) -> int:
        """End every credit whose deadline has passed; returns how many still held a mark."""
        ended = 0
        while self._deadlines and self._deadlines[0][0] <= now:
            _, serial, request_id = heapq.heappop(self._deadlines)
            credit = self._credits.get(request_id)
            if credit is not None and credit.serial == serial and self.release(request_id):
                ended += 1
        return ended

    def drop_worker(self, worker_id: str) -> None:
        """Forget every credit on ``worker_id`` (its epoch ended; the index dropped its marks)."""
        counts = self._counts.pop(worker_id, None)
        if counts:
            self._held -= len(counts)
        for rid in [rid for rid, c in self._credits.items() if c.worker_id == worker_id]:
            del self._credits[rid]

    def _uncount(self, worker_id: str, keys: frozenset[bytes]) -> int:
        """Drop one credit of each key; returns how many keys it still held."""
        counts = self._counts.get(worker_id)
        if counts is None:
            return 0
        held = 0
        gone: list[bytes] = []
        for key in keys:
            n = counts.get(key)
            if n is None:
                continue
            held += 1
            if n > 1:
                counts[key] = n - 1
            else:
                del counts[key]
                gone.append(key)
        if gone:
            self._held -= len(gone)
            self.index.remove(worker_id, "pending", gone)
        return held
