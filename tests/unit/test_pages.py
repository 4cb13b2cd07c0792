"""The simple free-list page allocator of the runtime (``kvrelay.worker.pages``)."""

from __future__ import annotations

import pytest

from kvrelay.worker.pages import PagePool, PoolExhaustedError, pages_for


def test_allocate_is_all_or_nothing_and_free_returns_pages() -> None:
    pool = PagePool(5)
    first = pool.allocate(3)
    assert first == [0, 1, 2] and pool.num_free == 2 and pool.num_allocated == 3
    assert pool.can_allocate(2) and not pool.can_allocate(3)
    with pytest.raises(PoolExhaustedError, match="only 2 of 5 are free"):
        pool.allocate(3)
    assert pool.num_free == 2, "a failed allocation takes nothing"
    pool.free(first)
    assert pool.num_free == 5 and pool.num_allocated == 0
    assert sorted(pool.allocate(5)) == [0, 1, 2, 3, 4]


def test_free_rejects_double_free_and_unknown_pages_changing_nothing() -> None:
    pool = PagePool(4)
    pages = pool.allocate(2)
    pool.free(pages[:1])
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(pages)  # pages[0] is already free
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([pages[1], pages[1]])
    assert pool.num_allocated == 1 and pool.num_free == 3


def test_rejects_bad_sizes_and_counts_pages() -> None:
    with pytest.raises(ValueError, match="at least one page"):
        PagePool(0)
    with pytest.raises(ValueError, match="negative"):
        PagePool(2).allocate(-1)
    assert [pages_for(n, 16) for n in (0, 1, 16, 17)] == [0, 1, 1, 2]
