"""A free-list allocator over the KV page pool of one worker (DESIGN.md section 8).

``PagePool(num_pages)`` hands out page indices ``0 .. num_pages - 1``. Invariant
after every call: each page is either free or allocated, never both, and
``num_free + num_allocated == num_pages``. ``allocate`` is all-or-nothing;
``free`` rejects pages that are not allocated (a double free is a bug, not a no-op).
Reference counts, reservations and the prefix index extend this class later.
"""

from __future__ import annotations

from collections.abc import Iterable


class PoolExhaustedError(RuntimeError):
    """Raised when more pages are asked for than are free."""


class PagePool:
    """Free-list of page indices; lowest indices are handed out first."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"a page pool needs at least one page, got num_pages={num_pages}")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._allocated: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_allocated(self) -> int:
        return len(self._allocated)

    def can_allocate(self, n: int) -> bool:
        """Whether ``allocate(n)`` would succeed now."""
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free pages, or raise ``PoolExhaustedError`` taking none."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > len(self._free):
            raise PoolExhaustedError(
                f"asked for {n} pages but only {len(self._free)} of {self.num_pages} are free; "
                "free finished sequences' pages or start the worker with more pages"
            )
        pages = [self._free.pop() for _ in range(n)]
        self._allocated.update(pages)
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return allocated ``pages``; raise ``ValueError`` (changing nothing) if any is not allocated."""
        pages = list(pages)
        unknown = [p for p in pages if p not in self._allocated]
        if unknown or len(set(pages)) != len(pages):
            raise ValueError(f"pages {sorted(set(unknown)) or pages} are not allocated (double free?)")
        self._allocated.difference_update(pages)
        self._free.extend(sorted(pages, reverse=True))


def pages_for(num_tokens: int, page_tokens: int) -> int:
    """Pages needed to hold ``num_tokens`` tokens at ``page_tokens`` per page."""
    return -(-num_tokens // page_tokens)
