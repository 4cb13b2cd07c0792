"""Prefill attention by its definition, in float64: the reference the prefill kernels' tests compare with."""

from __future__ import annotations

import torch

from kvrelay.models.kernels.prefill_attention import PrefillSpan

SCALE = 0.2


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, span: PrefillSpan, scale: float = SCALE
) -> torch.Tensor:
    """Attention by its definition, in float64: each query's softmax over the keys it sees (``span``), with the
    query heads of a KV head sharing it. Independent of the kernels under test."""
    queries, heads, _ = q.shape
    group = heads // k.shape[0]
    seen = [
        [
            span.first_key + i <= p and (span.window is None or span.first_key + i > p - span.window)
            for i in range(k.shape[1])
        ]
        for p in range(span.first_query, span.first_query + queries)
    ]
    keys, values = k.double().repeat_interleave(group, 0), v.double().repeat_interleave(group, 0)
    scores = torch.einsum("qhd,hkd->hqk", q.double(), keys) * scale
    scores = scores.masked_fill(~torch.tensor(seen), float("-inf"))
    return torch.einsum("hqk,hkd->qhd", torch.softmax(scores, dim=-1), values).to(q.dtype)
