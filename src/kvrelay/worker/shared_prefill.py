"""Sharing a prefix that another request on this worker is filling: re-match before the prefill, or wait.

Admission matches an offer's prefix against the chunks resident at that moment.
A follower admitted while another request (its leader) is still restoring or
computing the same chunks would compute them again. So, when a run is about to
enter the device queue (after admission and any restore), the controller

1. re-matches: the chunks of its chain that became resident since admission
   are shared, not computed (``rematch``: their pages are referenced, the
   reserved pages they replace go back to the pool);
2. if another started run is filling the next chunk it would compute, it waits
   for that run (``FillingChunks.wait``) instead of entering the device queue,
   and is re-matched again when the leader has registered its chunks (after its
   restore, at its first token) or has ended.

A run that entered the device queue never waits, so no two runs wait for each
other. The simulated worker (``sim/iteration.py``) follows the same rule.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvrelay.protocol.messages import Assignment
from kvrelay.worker.handlers import Run
from kvrelay.worker.page_pool import PagePool


class FillingChunks:
    """Which run is filling which chunk onto this worker's device, and the runs waiting for it."""

    def __init__(self) -> None:
        self._filler: dict[bytes, Run] = {}
        self._claims: dict[Assignment, list[bytes]] = {}
        self._waiters: dict[Assignment, list[Run]] = {}

    def claim(self, run: Run, keys: Sequence[bytes]) -> None:
        """``run`` is about to fill ``keys`` (a chunk another run already claims stays with that run)."""
        mine = self._claims.setdefault(run.offer.assignment, [])
        for key in keys:
            if self._filler.setdefault(key, run) is run:
                mine.append(key)

    def filler_of(self, key: bytes, run: Run) -> Run | None:
        """The started run, other than ``run``, that is filling ``key``; None when there is none."""
        filler = self._filler.get(key)
        return None if filler is None or filler is run or filler.fenced else filler

    def wait(self, run: Run, filler: Run) -> None:
        """Hold ``run`` until ``filler`` has registered its chunks or ended."""
        self._waiters.setdefault(filler.offer.assignment, []).append(run)

    def is_waiting(self, run: Run) -> bool:
        return any(run in waiters for waiters in self._waiters.values())

    def forget_waiter(self, run: Run) -> None:
        """``run`` no longer waits (it was fenced)."""
        for waiters in self._waiters.values():
            if run in waiters:
                waiters.remove(run)

    def filled(self, filler: Run) -> list[Run]:
        """``filler`` registered its chunks or ended: drop its claims; return the runs that waited for it."""
        for key in self._claims.pop(filler.offer.assignment, ()):
            if self._filler.get(key) is filler:
                del self._filler[key]
        return self._waiters.pop(filler.offer.assignment, [])

    def claimed_run(self, chain: Sequence[bytes], run: Run) -> int:
        """How many of ``chain``'s leading keys other started runs are filling (``run`` would share them)."""
        n = 0
        for key in chain:
            if self.filler_of(key, run) is None:
                break
            n += 1
        return n


def rematch(pool: PagePool, run: Run, chunk_tokens: int) -> int:
    """Share the chunks of ``run``'s chain that became resident after its registered prefix; returns how many.

    ``run`` has not entered the device queue: its page table is its registered prefix, then reserved pages
    in position order, and the reservation's head is the first page after the prefix. Each shared chunk's
    resident pages replace the reserved pages at its positions, which return to the pool.
    """
    chain = run.admission.chain
    reservation = run.admission.reservation
    assert reservation is not None
    found = pool.resident_prefix(chain[run.registered :])
    ppc = pool.pages_per_chunk
    start = run.registered * ppc
    if not found or run.taken != start:
        return 0
    n = len(found)
    pool.acquire(found)
    pool.release_leading(reservation, n * ppc)
    run.page_table[start : start + n * ppc] = [p for pages in found for p in pages]
    run.taken += n * ppc
    run.registered += n
    run.parent_key = chain[run.registered - 1]
    run.cached_tokens["gpu"] = run.cached_tokens.get("gpu", 0) + n * chunk_tokens
    run.rematched += n
    return n
