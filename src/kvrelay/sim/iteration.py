"""What one simulated device iteration takes and what it yields.

- Continuous batching: the device runs one iteration at a time. An iteration
  takes every decoding sequence (one token each) plus up to
  ``prefill_chunk_tokens`` prompt tokens of prefills (``take_prefills``: waiting
  ones join the queue at ``prefill_order.queue_position`` by the offer's priority,
  FIFO among equals; started ones go by acceptance time and a waiting one accepted
  earlier goes before them, as the live runtime's ``Job.place``:
  ``work.iteration_order``; each holds one of ``max_lanes`` lanes from its first
  chunk to its last token; chunked prefill as in vLLM and Sarathi-Serve), and lasts
  ``decode_step(lanes) + prefill tokens * prefill_s_per_token``. A prefill that
  completes yields its first token at the end of that iteration; a chunk that does
  not finish its prefill joins an iteration that already carries prompt tokens only
  if it is no larger than they are (the live runtime's ``plan_iteration``).
- Prefill start re-matches the prefix, as the live worker does: chunks of the
  chain that another request put on the device since admission are shared,
  not computed. A prefill whose next chunk another started request is
  restoring or computing waits for it (without a lane) instead of computing it
  twice; started work never waits, so nothing waits in a cycle.
- Tokens are ``token_value(seed, absolute position)``, so a continuation draws
  what the first attempt would have. Deltas go out at the first token, then every
  ``delta_tokens`` tokens, and the rest with the result (``delta_of``).
"""

from __future__ import annotations

from kvrelay.core.planning.prefill_order import queue_position
from kvrelay.core.worker import events as worker_events
from kvrelay.sim.cache import WorkerCaches
from kvrelay.sim.filling import Filling, rematch
from kvrelay.sim.tokens import token_value
from kvrelay.sim.work import Work, WorkerStats, iteration_order


def enqueue(queue: list[Work], work: Work) -> None:
    """Queue ``work`` for prefill at its priority's place; started prefills stay first."""
    started = sum(1 for w in queue if w.prefill_started_at is not None)
    queue.insert(queue_position([w.offer.priority for w in queue], started, work.offer.priority), work)


def prefill_to_do(work: Work, filling: Filling | None, caches: WorkerCaches, chunk_tokens: int) -> int:
    """Prompt tokens ``work`` will compute: for a prefill not started, less the leading chunks that are on the
    device or that another started request is filling (it will share them); None ``filling``: no re-match."""
    if work.prefill_started_at is not None or filling is None:
        return work.prefill_left
    return work.prefill_left - filling.shared_chunks(work, caches.gpu) * chunk_tokens


def take_prefills(
    queue: list[Work],
    lanes: int,
    budget: int,
    now: float,
    caches: WorkerCaches,
    filling: Filling | None,
    chunk_tokens: int,
    stats: WorkerStats,
) -> list[tuple[Work, int]]:
    """The prefills of ``queue`` that join the next iteration and the prompt tokens each takes, with ``lanes``
    free beside the decoding ones and ``budget`` prompt tokens. A prefill that joins for the first time starts
    now (with ``filling``, after re-matching its prefix; None: no re-match). Leaves started prefills first in
    ``queue``."""
    prefill: list[tuple[Work, int]] = []
    lanes -= sum(1 for work in queue if work.prefill_started_at is not None)
    carried = 0
    for work in iteration_order(queue):  # an admitted prefill holds its lane even without budget
        if work.prefill_started_at is None:
            if lanes <= 0:
                continue
            if filling is not None:
                stats.rematched_chunks += rematch(work, caches, chunk_tokens)
                if filling.waits(work):
                    stats.deferred += 1
                    continue
            lanes -= 1
        if budget <= 0:
            continue
        take = min(work.prefill_left, budget)
        if take < work.prefill_left and 0 < carried < take:  # as the live runtime's ``plan_iteration``
            budget = 0
            continue
        prefill.append((work, take))
        budget -= take
        carried += take
        if work.prefill_started_at is None:
            work.prefill_started_at = now
            if filling is not None:
                filling.claim(work, work.computed)
    queue.sort(key=lambda x: x.prefill_started_at is None)  # stable: started first, then waiting
    return prefill


def delta_of(now: float, work: Work, delta_tokens: int) -> worker_events.TokensProduced | None:
    """The delta of ``work``'s tokens not yet emitted, when one is due (its first token, every ``delta_tokens``
    tokens, and its last); marks them emitted."""
    offer = work.offer
    done = work.generated >= offer.max_new_tokens
    due = work.emitted == 0 or work.generated - work.emitted >= delta_tokens or done
    if not due or work.generated <= work.emitted:
        return None
    base, seed = len(offer.prompt), offer.sampling.seed
    tokens = tuple(token_value(seed, base + i) for i in range(work.emitted, work.generated))
    work.emitted = work.generated
    return worker_events.TokensProduced(now, offer.assignment, tokens)
