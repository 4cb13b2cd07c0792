"""The last decoder layer of a prefill-only forward, for the sampled rows alone.

A forward's last layer feeds only the LM head: its keys and values go to the pool for every new token (later
tokens attend to them), but its attention, output projection and MLP matter only for the rows whose logits are
wanted. ``sampled_rows`` says when the last layer may finish those rows alone: no sequence of the forward decodes
(a decode row keeps the path it takes in every step, so its token never depends on the rows beside it) and each
wanted row is the last new token of its own sequence (a prompt's chunk that ends it). The rows then attend as one
query each over their sequence's pages, through the decode attention of ``attention_plan``'s decode groups, and
their output projection and MLP run on those rows only (``layers.attention_then_tail``): in a cold 4,096-token
prefill of Gemma 3 270M that skips a full-attention layer's 4,096 queries and 4,095 rows of its MLP.

The first token's value is a function of the prompt alone as before (every prompt's last row takes this path),
its rounding that of the decode kernels rather than the prefill kernels; every key and value written is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrelay.models.batch import ForwardBatch
from kvrelay.models.kernels.attention_plan import AttentionPlan, plan_attention


@dataclass(frozen=True, slots=True)
class SampledRows:
    """The rows of layer ``layer`` that go on past its keys and values: ``rows`` (``[N]``, rows of the forward in
    the order of its ``logits_indices``), attending as planned by ``plan`` (one query per row; ``None`` when
    ``N`` is 0)."""

    layer: int
    rows: torch.Tensor
    plan: AttentionPlan | None


def sampled_rows(
    batch: ForwardBatch,
    page_tokens: int,
    sliding_window: int | None,
    device: torch.device,
    dtype: torch.dtype,
    layer: int,
) -> SampledRows | None:
    """The sampled rows of ``batch`` for its last layer ``layer``; ``None`` where the layer must run every row
    (a sequence decodes, or a wanted row is not the last new token of a sequence of its own)."""
    if any(q == 1 for q in batch.query_lens):
        return None
    last_rows = torch.tensor(batch.query_lens).cumsum(0).sub_(1).tolist()
    seq_of_last_row = {row: seq for seq, row in enumerate(last_rows)}
    wanted = batch.logits_indices.to("cpu").tolist()
    seqs = [seq_of_last_row.get(row) for row in wanted]
    if None in seqs or len(set(seqs)) != len(seqs):
        return None
    rows = torch.tensor(wanted, dtype=torch.long, device=device)
    if not wanted:
        return SampledRows(layer, rows, None)
    chosen = torch.tensor(seqs, dtype=torch.long)
    queries = ForwardBatch(
        input_ids=batch.input_ids.to("cpu")[wanted],
        positions=batch.positions.to("cpu")[wanted],
        query_lens=[1] * len(wanted),
        seq_lens=[batch.seq_lens[s] for s in seqs if s is not None],
        page_tables=batch.page_tables.to("cpu")[chosen],
        logits_indices=torch.arange(len(wanted)),
    )
    return SampledRows(layer, rows, plan_attention(queries, page_tokens, sliding_window, device, dtype))
