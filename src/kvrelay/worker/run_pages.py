"""A run's pages and chunks: its reservation consumed as the sequence grows, its full chunks indexed.

The page table lists every reserved page up front (nobody else can take them); ``take_pages`` accounts
them as taken in the pool as positions are reached, and ``register_chunks`` indexes each full chunk
whose pages are taken under its chain key (and hands it to the checkpointer), so it stays resident as
cache after the run. ``replay_count`` is how many of a continuation's delivered tokens its job replays
as decode rows.
"""

from __future__ import annotations

from kvrelay.protocol.chunk_keys import chunk_key
from kvrelay.protocol.messages import Offer
from kvrelay.worker.handlers import Run
from kvrelay.worker.kv_capture import Checkpointer
from kvrelay.worker.page_pool import PagePool


def take_pages(pool: PagePool, run: Run, pages: int) -> None:
    """Account the first ``pages`` pages of ``run``'s page table as taken (no-op for those already taken)."""
    pages = min(pages, len(run.page_table))
    if pages > run.taken:
        reservation = run.admission.reservation
        assert reservation is not None
        pool.take(reservation, pages - run.taken)
        run.taken = pages


def register_chunks(
    pool: PagePool, run: Run, chunks: int, tokens: tuple[int, ...], chunk_tokens: int, checkpointer: Checkpointer | None
) -> None:
    """Index ``run``'s full chunks of ``tokens`` up to ``chunks``, as far as their pages are taken."""
    ppc = pool.pages_per_chunk
    chunks = min(chunks, len(tokens) // chunk_tokens, run.taken // ppc)
    while run.registered < chunks:
        i = run.registered
        key = chunk_key(run.parent_key, tokens[i * chunk_tokens : (i + 1) * chunk_tokens])
        pages = run.page_table[i * ppc : (i + 1) * ppc]
        if pool.register(key, pages) and checkpointer is not None:
            checkpointer.capture(key, pages)
        run.parent_key = key
        run.registered += 1


def replay_count(offer: Offer, cached: int, exact_continuations: bool) -> int:
    """How many of the job's tokens (``offer.prompt[cached:]``) to replay as decode rows: the delivered
    tokens that are not resident, all but one when no prompt token is left to prefill (a one-token
    prefill chunk is a decode row already); none unless ``exact_continuations``."""
    if not exact_continuations or offer.generated_before == 0:
        return 0
    left = len(offer.prompt) - cached
    return max(0, min(offer.generated_before, left - 1))
