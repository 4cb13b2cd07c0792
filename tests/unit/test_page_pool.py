"""The page pool keeps free + cached + referenced + reserved = total after every operation."""

from __future__ import annotations

import random

import pytest

from kvrelay.worker.page_pool import PagePool, PagePoolError, PoolExhaustedError


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def write_chunks(pool: PagePool, owner: str, keys: list[bytes]) -> list[int]:
    """A sequence that reserves, fills and registers ``keys`` as full chunks."""
    r = pool.reserve(owner, len(keys) * pool.pages_per_chunk)
    assert r is not None
    pages = pool.take(r, len(keys) * pool.pages_per_chunk)
    for i, k in enumerate(keys):
        pool.register(k, pages[i * pool.pages_per_chunk : (i + 1) * pool.pages_per_chunk])
    pool.release(r)
    pool.check()
    return pages


def test_reserve_take_release_round_trip() -> None:
    pool = PagePool(16, page_tokens=16, chunk_tokens=64)
    r = pool.reserve("a", 10)
    assert r is not None and pool.num_reserved == 10 and pool.num_free == 6
    pool.check()
    pages = pool.take(r, 3)
    assert pool.num_referenced == 3 and r.remaining == 7
    pool.check()
    assert pool.release(r) == 7
    pool.unref(pages)
    pool.check()
    assert pool.num_free == 16
    with pytest.raises(PagePoolError):
        pool.release(r)


def test_reservation_is_all_or_nothing() -> None:
    pool = PagePool(8)
    assert pool.reserve("a", 9) is None
    assert pool.num_free == 8
    pool.check()


def test_released_chunks_are_cached_then_reused_by_prefix() -> None:
    pool = PagePool(16)
    pages = write_chunks(pool, "a", [key(1), key(2)])
    pool.unref(pages)
    pool.check()
    assert pool.num_cached == 8 and pool.num_free == 8
    prefix = pool.resident_prefix([key(1), key(2), key(3)])
    assert [list(p) for p in prefix] == [pages[:4], pages[4:]]
    pool.acquire(prefix)
    assert pool.num_cached == 0 and pool.num_referenced == 8
    pool.check()


def test_eviction_takes_durable_chunks_first_then_lru_and_spares_protected_pages() -> None:
    pool = PagePool(12)
    a = write_chunks(pool, "a", [key(1)])
    b = write_chunks(pool, "b", [key(2)])
    c = write_chunks(pool, "c", [key(3)])
    for pages in (a, b, c):
        pool.unref(pages)
    pool.mark_durable(key(3))
    plan = pool.plan_reserve(8, protected=a)
    assert plan is not None
    assert [(e.key, e.reason) for e in plan.evictions] == [(key(3), "durable"), (key(2), "lru")]
    r = pool.reserve("d", 8, protected=a)
    assert r is not None and pool.resident_prefix([key(1)]) and not pool.resident_prefix([key(2)])
    assert [e.reason for e in pool.evictions] == ["durable", "lru"]
    pool.check()


def test_a_chain_is_evicted_from_its_tail() -> None:
    pool = PagePool(12)
    pages = write_chunks(pool, "a", [key(1), key(2), key(3)])
    pool.unref(pages)
    r = pool.reserve("b", 4)
    assert r is not None
    assert [e.key for e in pool.evictions] == [key(3)]
    assert len(pool.resident_prefix([key(1), key(2), key(3)])) == 2


def test_misuse_raises() -> None:
    pool = PagePool(8)
    r = pool.reserve("a", 2)
    assert r is not None
    with pytest.raises(PagePoolError):
        pool.take(r, 3)
    pages = pool.take(r, 2)
    pool.unref(pages)
    with pytest.raises(PagePoolError):
        pool.unref(pages)


def test_random_operations_keep_the_invariant() -> None:
    seed = 20261129
    print(f"seed={seed}")
    rng = random.Random(seed)
    pool = PagePool(64)
    live: list[tuple[object, list[int]]] = []
    next_key = 0
    for _ in range(3000):
        op = rng.random()
        if op < 0.35:
            n_chunks = rng.randrange(1, 4)
            reuse = pool.resident_prefix([key(rng.randrange(max(next_key, 1)))])
            protected = [p for ch in reuse for p in ch]
            r = pool.reserve("s", n_chunks * 4 + rng.randrange(0, 3), protected)
            if r is not None:
                pool.acquire(reuse)
                pages = [p for ch in reuse for p in ch]
                taken = pool.take(r, n_chunks * 4)
                for i in range(n_chunks):
                    if rng.random() < 0.7:
                        pool.register(key(next_key), taken[i * 4 : (i + 1) * 4])
                        next_key += 1
                live.append((r, pages + taken))
        elif op < 0.7 and live:
            r, pages = live.pop(rng.randrange(len(live)))
            pool.release(r)  # type: ignore[arg-type]
            pool.unref(pages)
        elif op < 0.8 and next_key:
            pool.mark_durable(key(rng.randrange(next_key)))
        pool.check()
    for r, pages in live:
        pool.release(r)  # type: ignore[arg-type]
        pool.unref(pages)
    pool.check()
    assert pool.num_referenced == 0 and pool.num_reserved == 0


def test_allocate_and_free_without_admission() -> None:
    pool = PagePool(8)
    pages = pool.allocate(6)
    assert len(set(pages)) == 6 and pool.num_referenced == 6 and pool.num_reserved == 0
    pool.check()
    with pytest.raises(PoolExhaustedError, match="only 2 of 8 are free"):
        pool.allocate(3)
    pool.free(pages)
    pool.check()
    assert pool.num_free == 8
