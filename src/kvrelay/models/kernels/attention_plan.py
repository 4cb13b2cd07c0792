"""Which queries of a forward attend together, over which pages: ``plan_attention`` (see ``attention``).

Per forward pass ``plan_attention`` turns a ``ForwardBatch`` into an ``AttentionPlan``: the pool slot
of every new token, and per layer type the groups of queries that attend together. Decoding sequences
(one new token each) form a few groups of similar length (``split_by_length``; often one), whose
padded key windows span the pages each member needs; a prefilling sequence is a group of its own. On CPU
that group is attended by its span (``prefill_attention``: each query block over the keys it sees), so it
carries no mask and a sliding layer's group holds the whole chunk; elsewhere it attends through a mask of
queries by keys, and sliding layers split it into groups of ``sliding_window`` queries. Key windows of
sliding layers start at the oldest page the window can reach. Decoding sequences that the model mirrors per lane
(``window_mirror``) are left out of the sliding-layer groups (``mirrored``); full-attention decode
groups of batches whose decode rows all have lanes are marked to be kept between steps
(``kept_gathers``).

Masks: query at position ``q`` sees key position ``k`` iff ``k <= q`` and, in sliding layers,
``k > q - sliding_window`` (the window counts the query).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from kvrelay.models.batch import ForwardBatch
from kvrelay.models.kernels.kept_gathers import KeptGroup
from kvrelay.models.kernels.prefill_attention import PrefillSpan

GROUP_COST_TOKENS = 1024
"""Padding, in key tokens per layer, worth one more decode group (one more gather and attention call per layer)."""

KEPT_PAGE_QUANTUM = 4
"""Full-attention decode groups of batches whose decode rows all have lanes span a multiple of
this many pages (and are grouped by lengths rounded up to it), so a kept window
(``kept_gathers``) outlives more steps: a group's width, and the grouping, change when a
member crosses a quantum, not a page."""

KEPT_GROUP_COST_TOKENS = 4096
"""``GROUP_COST_TOKENS`` for groups whose windows are kept: with no gather per step, a group
costs only its calls (append, attention, row select and scatter), so more padding is worth
a group (the figures behind the value: docs/performance.md, "Kept decode groups")."""


@dataclass(frozen=True, slots=True)
class AttentionGroup:
    """``G`` sequences with ``Q`` queries each, attending over ``n`` gathered pages each.

    ``query_rows`` (``[G * Q]``) are the rows of the batch's new tokens, or
    ``None`` when the group is all of them, in order. ``pages`` is ``[G, n]``;
    ``mask`` is ``[G, 1, Q, n * page_tokens]``, additive: 0 where the query sees the
    key, ``-inf`` elsewhere; or ``None`` for a prefill group on CPU (attended by its ``span``)
    and for a prefill from position 0 whose window does not bind, where the first ``Q``
    keys are attended with a plain causal mask (which lets the attention kernel skip the
    masked blocks).
    ``kept`` identifies a full-attention decode group of a batch whose decode rows all have
    lanes, so its gathered window can be kept between steps (``kept_gathers``); else ``None``.
    ``span`` places the queries and gathered keys of a prefill group (one sequence, ``Q > 1``),
    which attends through ``prefill_attention_auto`` on CPU; else ``None``.
    ``visible`` (``[G]``, on the CPU) counts the leading keys each sequence sees when that
    is all its mask says (decode groups without a window); else ``None``. ``page_run`` is
    the first page when the group is one sequence whose ``n`` pages are consecutive in the
    pool, so its keys and values are read there in place instead of gathered; else ``None``.
    """

    query_rows: torch.Tensor | None
    pages: torch.Tensor
    mask: torch.Tensor | None
    queries_per_seq: int
    kept: KeptGroup | None = None
    visible: torch.Tensor | None = None
    page_run: int | None = None
    span: PrefillSpan | None = None


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """Where one step's new tokens go (``slots``: ``page * page_tokens + offset``; ``slot_run``: the first
    slot when they are consecutive, ascending, else ``None``) and how they attend."""

    slots: torch.Tensor
    full: tuple[AttentionGroup, ...]
    sliding: tuple[AttentionGroup, ...]
    num_tokens: int
    slot_run: int | None = None


def plan_attention(
    batch: ForwardBatch,
    page_tokens: int,
    sliding_window: int | None,
    device: torch.device,
    dtype: torch.dtype,
    mirrored: frozenset[int] = frozenset(),
) -> AttentionPlan:
    """The attention plan of ``batch`` for a pool of ``page_tokens``-token pages; masks in ``dtype``.

    Decoding sequences listed in ``mirrored`` get no sliding-layer group (their
    sliding attention reads a ``window_mirror`` ring instead).

    Raises ``ValueError`` when a page table is too short for its sequence or the
    positions disagree with ``seq_lens``.
    """
    tables = batch.page_tables.to("cpu", torch.long)
    positions = batch.positions.to("cpu", torch.long)
    query_lens = torch.tensor(batch.query_lens, dtype=torch.long)
    seq_lens = torch.tensor(batch.seq_lens, dtype=torch.long)
    _check(batch, tables, positions, query_lens, seq_lens, page_tokens)

    seq_of_token = torch.repeat_interleave(torch.arange(batch.num_seqs), query_lens)
    page_of_token = tables[seq_of_token, positions // page_tokens]
    slots = page_of_token * page_tokens + positions % page_tokens

    decoding = [i for i, q in enumerate(batch.query_lens) if q == 1]
    prefilling = [i for i, q in enumerate(batch.query_lens) if q > 1]
    starts = (query_lens.cumsum(0) - query_lens).tolist()
    windows = {"full": None, "sliding": sliding_window} if sliding_window is not None else {"full": None}
    groups: dict[str, list[AttentionGroup]] = {"full": [], "sliding": []}
    for kind, window in windows.items():
        paged = decoding if kind == "full" else [i for i in decoding if i not in mirrored]
        laned = batch.lanes is not None and all(batch.lanes[i] is not None for i in paged)
        quantum = KEPT_PAGE_QUANTUM if window is None and laned else 1
        cost = KEPT_GROUP_COST_TOKENS if quantum > 1 else GROUP_COST_TOKENS
        for members in split_by_length(_decode_key_tokens(batch, paged, page_tokens * quantum, window), cost):
            idx = torch.tensor([paged[m] for m in members], dtype=torch.long)
            whole = len(members) == batch.num_seqs
            rows = None if whole else torch.tensor([starts[paged[m]] for m in members], dtype=torch.long)
            q_pos = (seq_lens[idx] - 1).unsqueeze(1)
            group = _group(tables[idx], rows, q_pos, page_tokens, window, device, dtype, quantum)
            if quantum > 1:
                lanes = [batch.lanes[paged[m]] for m in members]  # type: ignore[index]
                width = group.pages.shape[1] * page_tokens
                window_rows = torch.arange(len(members)) * width + q_pos[:, 0]
                new_slots = slots[[starts[paged[m]] for m in members]]
                lengths = tuple(batch.seq_lens[paged[m]] for m in members)
                kept = KeptGroup(tuple(lanes), lengths, new_slots.to(device), window_rows.to(device))  # type: ignore[arg-type]
                group = replace(group, kept=kept)
            groups[kind].append(group)
        for i in prefilling:
            first, stop = starts[i], starts[i] + batch.query_lens[i]
            step = stop - first if window is None or device.type == "cpu" else window
            for lo in range(first, stop, step):
                hi = min(stop, lo + step)
                rows = None if batch.num_seqs == 1 and hi - lo == stop - first else torch.arange(lo, hi)
                q_pos = positions[lo:hi].unsqueeze(0)
                groups[kind].append(_group(tables[i : i + 1], rows, q_pos, page_tokens, window, device, dtype))
    return AttentionPlan(
        slots=slots.to(device),
        full=tuple(groups["full"]),
        sliding=tuple(groups["sliding"]),
        num_tokens=batch.num_tokens,
        slot_run=_run_start(slots),
    )


def split_by_length(key_tokens: list[int], group_cost: int) -> list[list[int]]:
    """Indices of ``key_tokens`` split into groups of similar length, each listed in ascending order.

    A group pads every member to its longest, so the split minimizes
    ``sum(len(group) * max(group)) + group_cost * len(groups)`` (an exact
    dynamic program over the sorted lengths).
    """
    order = sorted(range(len(key_tokens)), key=key_tokens.__getitem__)
    best = [0] + [math.inf] * len(order)
    cut = [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):
        longest = key_tokens[order[end - 1]]
        for start in range(end):
            cost = best[start] + (end - start) * longest + group_cost
            if cost < best[end]:
                best[end], cut[end] = cost, start
    groups: list[list[int]] = []
    end = len(order)
    while end > 0:
        groups.append(sorted(order[cut[end] : end]))
        end = cut[end]
    return groups[::-1]


def _decode_key_tokens(batch: ForwardBatch, decoding: list[int], page_tokens: int, window: int | None) -> list[int]:
    """Key tokens each decoding sequence gathers: its pages, or those its window reaches."""
    needs = []
    for i in decoding:
        last = batch.seq_lens[i] - 1
        first = 0 if window is None else max(0, last - window + 1)
        needs.append((last // page_tokens - first // page_tokens + 1) * page_tokens)
    return needs


def _check(
    batch: ForwardBatch,
    tables: torch.Tensor,
    positions: torch.Tensor,
    query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    page_tokens: int,
) -> None:
    pages_needed = (seq_lens + page_tokens - 1) // page_tokens
    too_short = (pages_needed > tables.shape[1]).nonzero().flatten().tolist()
    if too_short:
        i = too_short[0]
        raise ValueError(
            f"sequence {i}: {batch.seq_lens[i]} tokens need {int(pages_needed[i])} pages of {page_tokens} "
            f"tokens; its page table has {tables.shape[1]}"
        )
    last_positions = positions[query_lens.cumsum(0) - 1]
    wrong = (last_positions != seq_lens - 1).nonzero().flatten().tolist()
    if wrong:
        i = wrong[0]
        raise ValueError(
            f"sequence {i}: its last new token is at position {int(last_positions[i])}, "
            f"but seq_len {batch.seq_lens[i]} puts it at {batch.seq_lens[i] - 1}"
        )


def _group(
    tables: torch.Tensor,
    query_rows: torch.Tensor | None,
    q_pos: torch.Tensor,
    page_tokens: int,
    window: int | None,
    device: torch.device,
    dtype: torch.dtype,
    page_quantum: int = 1,
) -> AttentionGroup:
    """Gather indices and mask for sequences ``tables`` whose queries sit at ``q_pos`` (``[G, Q]``).

    Without a window the group spans a multiple of ``page_quantum`` pages; pages past a
    table's end repeat its last entry and are masked.
    """
    last_page = q_pos[:, -1] // page_tokens
    if window is None:
        first_page = torch.zeros_like(last_page)
        num_pages = -(-(int(last_page.max()) + 1) // page_quantum) * page_quantum
    else:
        first_page = (q_pos[:, 0] - window + 1).clamp(min=0) // page_tokens
        num_pages = int((last_page - first_page).max()) + 1
        first_page = last_page - num_pages + 1
    page_idx = first_page.unsqueeze(1) + torch.arange(num_pages)
    pages = tables.gather(1, page_idx.clamp(min=0, max=tables.shape[1] - 1))
    run = _page_run(pages)
    queries = q_pos.shape[1]
    span = None
    if q_pos.shape[0] == 1 and queries > 1:
        span = PrefillSpan(int(q_pos[0, 0]), int(page_idx[0, 0]) * page_tokens, window)
    plain_causal = q_pos.shape[0] == 1 and int(q_pos[0, 0]) == 0 and (window is None or queries <= window)
    if span is not None and (plain_causal or device.type == "cpu"):
        rows = None if query_rows is None else query_rows.to(device)
        return AttentionGroup(rows, pages.to(device), mask=None, queries_per_seq=queries, page_run=run, span=span)
    offsets = torch.arange(page_tokens)
    kv_pos = (page_idx.unsqueeze(2) * page_tokens + offsets).flatten(1)
    visible = (kv_pos >= 0).unsqueeze(1) & (kv_pos.unsqueeze(1) <= q_pos.unsqueeze(2))
    if window is not None:
        visible &= kv_pos.unsqueeze(1) > q_pos.unsqueeze(2) - window
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))
    return AttentionGroup(
        query_rows=None if query_rows is None else query_rows.to(device),
        pages=pages.to(device),
        mask=mask.unsqueeze(1).to(device),
        queries_per_seq=queries,
        visible=q_pos[:, 0] + 1 if window is None and queries == 1 else None,
        page_run=run,
        span=span,
    )


def _page_run(pages: torch.Tensor) -> int | None:
    """The first page of ``pages`` (``[G, n]``) when ``G == 1`` and they are consecutive, ascending; else None."""
    return _run_start(pages[0]) if pages.shape[0] == 1 else None


def _run_start(values: torch.Tensor) -> int | None:
    """The first of ``values`` (1-D, on the CPU) when they are consecutive, ascending; else None."""
    if values.shape[0] == 0:
        return None
    first = int(values[0])
    return first if torch.equal(values, torch.arange(first, first + values.shape[0])) else None
