"""One model step over several sequences: the tokens to run and where their KV lives.

A ``ForwardBatch`` holds ``B`` sequences. Sequence ``i`` brings ``query_lens[i]``
new tokens (concatenated, in sequence order, into ``input_ids``) at absolute
``positions``; after the step it has ``seq_lens[i]`` tokens in its pages, the
first ``seq_lens[i] - query_lens[i]`` of which were already resident. Row ``i`` of
``page_tables`` lists its pages in order (padded with 0). ``logits_indices``
names the rows of ``input_ids`` whose next-token logits the step returns, in
the order returned. ``lanes`` (optional) names, per sequence, the runtime lane
holding it and that lane's current owner (``LaneRef``), which lets the model
keep per-lane state between steps (``window_mirror``); ``None`` entries and a
``None`` tuple opt out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

NewSequence = tuple[Sequence[int], int, Sequence[int]]
"""``(new_tokens, start_pos, page_table)`` of one sequence in a step."""


class LaneRef(NamedTuple):
    """A stable physical ``slot`` and the ``owner`` of the sequence in it (changes when the slot is reused)."""

    slot: int
    owner: int


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """The inputs of one ``PagedModel.forward`` call (shapes: ``T`` new tokens, ``B`` sequences, ``N`` logit rows)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    query_lens: list[int]
    seq_lens: list[int]
    page_tables: torch.Tensor
    logits_indices: torch.Tensor
    lanes: tuple[LaneRef | None, ...] | None = None

    def __post_init__(self) -> None:
        total = sum(self.query_lens)
        if self.lanes is not None and len(self.lanes) != len(self.query_lens):
            raise ValueError(
                f"ForwardBatch needs one lane entry per sequence; got {len(self.lanes)} for {len(self.query_lens)}"
            )
        if len(self.query_lens) != len(self.seq_lens) or len(self.query_lens) != self.page_tables.shape[0]:
            raise ValueError(
                f"ForwardBatch needs one query_len, seq_len and page table row per sequence; got "
                f"{len(self.query_lens)}, {len(self.seq_lens)} and {self.page_tables.shape[0]}"
            )
        if self.input_ids.shape != (total,) or self.positions.shape != (total,):
            raise ValueError(
                f"ForwardBatch input_ids and positions must be 1-d of length sum(query_lens) = {total}; "
                f"got {tuple(self.input_ids.shape)} and {tuple(self.positions.shape)}"
            )
        for i, (q, s) in enumerate(zip(self.query_lens, self.seq_lens, strict=True)):
            if q < 1 or s < q:
                raise ValueError(f"sequence {i}: needs 1 <= query_len <= seq_len; got query_len {q}, seq_len {s}")

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def build(
        cls,
        seqs: Sequence[NewSequence],
        logits: Literal["last", "all"] = "last",
        device: str | torch.device = "cpu",
        lanes: Sequence[LaneRef | None] | None = None,
    ) -> ForwardBatch:
        """A batch of ``(new_tokens, start_pos, page_table)`` sequences.

        Positions run from ``start_pos`` on; ``logits="last"`` asks for the last new
        token of each sequence, ``"all"`` for every new token.
        """
        if not seqs:
            raise ValueError("ForwardBatch.build needs at least one sequence")
        if logits not in ("last", "all"):
            raise ValueError(f"logits must be 'last' or 'all'; got {logits!r}")
        ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        for i, (tokens, start, _) in enumerate(seqs):
            if len(tokens) == 0 or start < 0:
                raise ValueError(f"sequence {i}: needs at least one new token and start_pos >= 0")
            ids.extend(int(t) for t in tokens)
            positions.extend(range(start, start + len(tokens)))
            query_lens.append(len(tokens))
            seq_lens.append(start + len(tokens))
        max_pages = max(len(table) for _, _, table in seqs)
        tables = torch.zeros((len(seqs), max(max_pages, 1)), dtype=torch.long)
        for i, (_, _, table) in enumerate(seqs):
            tables[i, : len(table)] = torch.as_tensor(list(table), dtype=torch.long)
        ends = torch.tensor(query_lens).cumsum(0)
        wanted = ends - 1 if logits == "last" else torch.arange(int(ends[-1]))
        return cls(
            input_ids=torch.tensor(ids, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            query_lens=query_lens,
            seq_lens=seq_lens,
            page_tables=tables.to(device),
            logits_indices=wanted.to(device=device, dtype=torch.long),
            lanes=None if lanes is None else tuple(lanes),
        )
