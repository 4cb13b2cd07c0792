"""Local admission: validation, demand, protection, eviction planning and atomic reservation."""

from __future__ import annotations

import pytest

from kvrelay.protocol.chunk_keys import prompt_chain
from kvrelay.protocol.messages import Assignment, Offer, RouteSegment
from kvrelay.worker.admission import WorkerIdentity, admit
from kvrelay.worker.page_pool import PagePool

ME = WorkerIdentity("w0", 3, "m", b"fp", context_limit=4096)
PROMPT = tuple(range(1, 64 * 4 + 2))  # 4 cacheable chunks, 257 tokens


def offer(prompt: tuple[int, ...] = PROMPT, max_new: int = 31, **kw: object) -> Offer:
    fields: dict = dict(
        assignment=Assignment("r", 1),
        worker_id="w0",
        epoch=3,
        model="m",
        model_fingerprint=b"fp".hex(),
        prompt=prompt,
        max_new_tokens=max_new,
    )
    fields.update(kw)
    return Offer(**fields)


@pytest.mark.parametrize(
    ("kw", "reason"),
    [
        ({"epoch": 2}, "wrong_epoch"),
        ({"model": "x"}, "wrong_model"),
        ({"model_fingerprint": "00", "route": (RouteSegment("ram", 1),)}, "wrong_model"),
        ({"max_new": 4000}, "over_context_limit"),
        ({"chain": (b"\x00" * 16,)}, "wrong_model"),
        ({"route": (RouteSegment("gpu", 2),)}, "stale_route"),
    ],
)
def test_declines_name_the_reason_and_change_nothing(kw: dict, reason: str) -> None:
    pool = PagePool(64)
    max_new = kw.pop("max_new", 31)
    result = admit(pool, ME, offer(max_new=max_new, **kw))
    assert not result.accepted and result.reason == reason and result.detail
    assert pool.num_free == 64 and pool.num_reserved == 0


def test_a_recompute_offer_of_another_fingerprint_is_served() -> None:
    """A mixed cluster's router plans one engine's chain; the other engine's workers get recompute offers."""
    result = admit(PagePool(64), ME, offer(model_fingerprint="ab" * 16))
    assert result.accepted and result.prefix == ()


def test_shutting_down_declines() -> None:
    result = admit(PagePool(64), ME, offer(), shutting_down=True)
    assert result.reason == "shutting_down"


def test_demand_counts_prompt_plus_budget_minus_shared_prefix() -> None:
    pool = PagePool(64)
    cold = admit(pool, ME, offer())
    assert cold.accepted and cold.demand == 18  # ceil((257 + 31) / 16)
    # Fill the prompt's 4 chunks, index them, end the sequence: they stay cached.
    pages = pool.take(cold.reservation, 16)
    chain = prompt_chain(b"fp", PROMPT, 64)
    for i, key in enumerate(chain):
        pool.register(key, pages[i * 4 : (i + 1) * 4])
    pool.release(cold.reservation)
    pool.unref(pages)
    warm = admit(pool, ME, offer(assignment=Assignment("r2", 1), route=(RouteSegment("gpu", 4),)))
    assert warm.accepted and warm.demand == 18 - 16 and len(warm.prefix) == 4
    assert pool.num_cached == 0  # the prefix is referenced now, not evictable
    pool.check()


def test_no_capacity_when_protected_prefix_is_all_that_could_be_evicted() -> None:
    pool = PagePool(20)
    first = admit(pool, ME, offer())
    pages = pool.take(first.reservation, 16)
    for i, key in enumerate(prompt_chain(b"fp", PROMPT, 64)):
        pool.register(key, pages[i * 4 : (i + 1) * 4])
    pool.release(first.reservation)
    pool.unref(pages)
    # A longer request sharing the prefix needs 4 + 16 pages beyond the 16 shared: only 4 free.
    long_prompt = PROMPT + tuple(range(1000, 1256))
    result = admit(pool, ME, offer(prompt=long_prompt, assignment=Assignment("r3", 1)))
    assert not result.accepted and result.reason == "no_capacity"
    assert pool.num_cached == 16
    pool.check()


def test_admitted_requests_always_finish_their_full_budget() -> None:
    pool = PagePool(200)
    admitted = []
    n = 0
    while True:
        prompt = tuple(range(n * 1000, n * 1000 + 40 + 17 * n))
        result = admit(pool, ME, offer(prompt=prompt, max_new=50, assignment=Assignment(f"r{n}", 1)))
        n += 1
        if not result.accepted:
            assert result.reason == "no_capacity"
            break
        admitted.append((prompt, result))
    assert len(admitted) >= 3
    # Every admitted sequence writes its prompt and all 50 tokens, one page at a time.
    for prompt, result in admitted:
        held: list[int] = []
        for position in range(len(prompt) + 50):
            if position % 16 == 0:
                held += pool.take(result.reservation, 1)
            pool.check()
        pool.release(result.reservation)
        pool.unref(held)
    pool.check()
    assert pool.num_free == 200
