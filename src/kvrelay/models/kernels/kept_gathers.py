"""Gathered keys and values of full-attention decode groups, kept from one step to the next.

A decode group of a full-attention layer gathers its members' pages into a padded
``[G, n * page_tokens]`` window every step (``attention._gather``), although between two
steps only one position per member changes: the token the last step wrote. ``KeptGathers``
keeps each group's gathered keys and values and, when the next step brings the same
group again, copies just those new positions from the pool into it. A group is the same
when its members (lane slot and owner, in order, from ``ForwardBatch.lanes``) and its
page ids are the same and every member is exactly one token longer than when the kept
copy was last brought up to date; anything else gathers afresh. The pages stay the
source of truth: a kept copy equals what a fresh gather would read at every position a
member can see (positions past a member's length are masked, whatever they hold).

A group's page count grows by one when its longest member crosses a page boundary, so
a group is gathered afresh once per ``page_tokens`` steps at most.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrelay.models.batch import LaneRef
from kvrelay.models.kernels.kv_pages import gather_pages


@dataclass(frozen=True, slots=True)
class KeptGroup:
    """What identifies a decode group between steps, and where its new tokens are.

    ``members`` are the lanes of the group's sequences, in group order; ``lengths`` their
    token counts after this step; ``new_slots`` (``[G]``) the pool slot of each member's
    newest token (``page * page_tokens + offset``), already written; ``window_rows``
    (``[G]``) where that token sits in the group's window flattened to ``[G * width]``.
    """

    members: tuple[LaneRef, ...]
    lengths: tuple[int, ...]
    new_slots: torch.Tensor
    window_rows: torch.Tensor


@dataclass(slots=True)
class _Kept:
    pages: torch.Tensor
    lengths: tuple[int, ...]
    k: torch.Tensor
    v: torch.Tensor


class KeptGathers:
    """Kept gathered windows per (layer pool, group members), dropped when a step does not use them.

    Not thread-safe: one model step at a time (as ``PagedModel.forward``).
    """

    def __init__(self) -> None:
        self._kept: dict[tuple[int, tuple[LaneRef, ...]], _Kept] = {}
        self._used: set[tuple[int, tuple[LaneRef, ...]]] = set()

    def __len__(self) -> int:
        return len(self._kept)

    def keys_values(
        self, k_pool: torch.Tensor, v_pool: torch.Tensor, pages: torch.Tensor, group: KeptGroup
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The group's keys and values as ``[G, n * page_tokens, kv_heads, head_dim]`` (pool dtype).

        ``pages`` (``[G, n]``) are the group's page ids; the pool must already hold this
        step's new tokens.
        """
        key = (k_pool.data_ptr(), group.members)
        self._used.add(key)
        kept = self._kept.get(key)
        if kept is not None and _extends(kept, pages, group.lengths):
            self._append(kept, k_pool, v_pool, group)
        else:
            kept = self._gather(k_pool, v_pool, pages, group.lengths, kept)
            self._kept[key] = kept
        return kept.k, kept.v

    def end_step(self) -> None:
        """Drop the kept windows this step did not use (their groups are gone or changed)."""
        for key in self._kept.keys() - self._used:
            del self._kept[key]
        self._used.clear()

    def clear(self) -> None:
        """Drop everything (a step failed, so kept windows may be half updated)."""
        self._kept.clear()
        self._used.clear()

    @staticmethod
    def _gather(
        k_pool: torch.Tensor, v_pool: torch.Tensor, pages: torch.Tensor, lengths: tuple[int, ...], old: _Kept | None
    ) -> _Kept:
        """A fresh window of ``pages``, in ``old``'s storage when it has the same shape (no new pages to fault in)."""
        num_seqs, num_pages = pages.shape
        _, page_tokens, kv_heads, head_dim = k_pool.shape
        shape = (num_seqs, num_pages * page_tokens, kv_heads, head_dim)
        if old is None or old.k.shape != shape or old.k.dtype != k_pool.dtype:
            k, v = k_pool.new_empty(shape), v_pool.new_empty(shape)
        else:
            k, v = old.k, old.v
        gather_pages(k_pool, v_pool, pages, k, v)
        return _Kept(pages.clone(), lengths, k, v)

    @staticmethod
    def _append(kept: _Kept, k_pool: torch.Tensor, v_pool: torch.Tensor, group: KeptGroup) -> None:
        for pool, out in ((k_pool, kept.k), (v_pool, kept.v)):
            new = pool.view(-1, *pool.shape[2:]).index_select(0, group.new_slots)
            out.view(-1, *out.shape[2:]).index_copy_(0, group.window_rows, new)
        kept.lengths = group.lengths


def _extends(kept: _Kept, pages: torch.Tensor, lengths: tuple[int, ...]) -> bool:
    """Whether ``kept`` is this group one token ago, on the same pages."""
    return (
        kept.pages.shape == pages.shape
        and all(now == before + 1 for now, before in zip(lengths, kept.lengths, strict=True))
        and torch.equal(kept.pages, pages)
    )
