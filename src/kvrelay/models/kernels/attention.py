"""Causal (and sliding-window) attention over a paged KV pool, in plain PyTorch.

Per forward pass ``attention_plan.plan_attention`` turns a ``ForwardBatch`` into an
``AttentionPlan``: the pool slot of every new token, and groups of queries that
attend together; ``paged_attention`` runs one layer's groups. Per decode group
and layer, its pages are gathered with one ``index_select`` into a padded
``[G, L]`` key window (reused storage, ``GatherBuffers``) and attended with one
``decode_attention`` (two batched matmuls over the whole group), or the window
kept from the previous step is appended to (``kept_gathers``). A prefilling
sequence's group runs the prefill attention (``prefill_attention``). Key windows
of sliding layers start at the oldest page the window can reach, so a decode
step costs ``O(sliding_window)`` there, not ``O(sequence)``. This is the split
vLLM and nano-vllm make between varlen prefill and paged decode kernels
(github.com/GeeeekExplorer/nano-vllm, ``layers/attention.py``), written with
gathers instead of custom kernels so it runs on CPU and CUDA alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvrelay.models.kernels.attention_plan import AttentionGroup
from kvrelay.models.kernels.huge_pages import huge_page_empty
from kvrelay.models.kernels.kept_gathers import KeptGathers
from kvrelay.models.kernels.kv_pages import gather_pages
from kvrelay.models.kernels.native.attention import decode_attention_native
from kvrelay.models.kernels.prefill_attention import prefill_attention_auto


class GatherBuffers:
    """Reused storage for one layer's gathered keys and values, grown to the largest window seen,
    and the windows of full-attention decode groups kept between steps (``kept``).

    Fresh multi-megabyte tensors per layer cost a page fault per 4 KiB on CPU
    (tens of thousands per decode step); reusing one pair avoids that. Not
    shareable between threads: one model step at a time uses it.
    """

    def __init__(self) -> None:
        self.k = torch.empty(0)
        self.v = torch.empty(0)
        self.kept = KeptGathers()

    def take(self, rows: int, pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Two ``[rows, page elements]`` views for gathering pages of ``pool`` (``[pages, P, kv_heads, D]``)."""
        row = pool[0].numel()
        need = rows * row
        if self.k.numel() < need or self.k.dtype != pool.dtype or self.k.device != pool.device:
            self.k = huge_page_empty((need,), pool.dtype, pool.device)
            self.v = huge_page_empty((need,), pool.dtype, pool.device)
        return self.k[:need].view(rows, row), self.v[:need].view(rows, row)


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    groups: tuple[AttentionGroup, ...],
    scale: float,
    buffers: GatherBuffers,
) -> torch.Tensor:
    """Attention output ``[T, heads, head_dim]`` of queries ``q`` over one layer's pool ``[pages, P, kv_heads, D]``.

    The new tokens' keys and values must already be in the pool (``write_kv``).
    """
    if len(groups) == 1 and groups[0].query_rows is None:
        return _attend(q, k_pool, v_pool, groups[0], scale, buffers)
    out = torch.empty_like(q)
    for group in groups:
        assert group.query_rows is not None
        attended = _attend(q.index_select(0, group.query_rows), k_pool, v_pool, group, scale, buffers)
        out.index_copy_(0, group.query_rows, attended)
    return out


def _attend(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    group: AttentionGroup,
    scale: float,
    buffers: GatherBuffers,
) -> torch.Tensor:
    if group.queries_per_seq == 1:
        return _attend_decode(q, k_pool, v_pool, group, scale, buffers)
    heads, head_dim = q.shape[1], q.shape[2]
    k, v = _gather(k_pool, v_pool, group, buffers, q.dtype)
    if group.span is not None and q.device.type == "cpu":
        return prefill_attention_auto(q, k[0], v[0], group.span, scale)
    queries = q.view(group.pages.shape[0], group.queries_per_seq, heads, head_dim).transpose(1, 2)
    gqa = k.shape[1] != heads
    if group.mask is None:
        keys = group.queries_per_seq
        out = F.scaled_dot_product_attention(
            queries, k[:, :, :keys], v[:, :, :keys], is_causal=True, scale=scale, enable_gqa=gqa
        )
    else:
        out = F.scaled_dot_product_attention(queries, k, v, attn_mask=group.mask, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2).reshape(-1, heads, head_dim)


def _attend_decode(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    group: AttentionGroup,
    scale: float,
    buffers: GatherBuffers,
) -> torch.Tensor:
    """One query per sequence: the group's pages gathered at once, then ``decode_attention`` with the
    query heads sharing a KV head as that head's rows, so each gathered key is read once per KV head."""
    num_seqs = group.pages.shape[0]
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_pool.shape[2]
    assert group.mask is not None, "decode groups always carry a mask"
    if group.kept is None:
        k, v = _gather(k_pool, v_pool, group, buffers, q.dtype)
    else:
        kept_k, kept_v = buffers.kept.keys_values(k_pool, v_pool, group.pages, group.kept)
        k, v = kept_k.transpose(1, 2).to(q.dtype), kept_v.transpose(1, 2).to(q.dtype)
    queries = q.view(num_seqs, kv_heads, heads // kv_heads, head_dim)
    out = None if group.visible is None else decode_attention_native(queries, k, v, group.visible, scale)
    if out is None:
        out = decode_attention(queries, k, v, group.mask, scale)
    return out.reshape(num_seqs, heads, head_dim)


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """``softmax(q k^T * scale + mask) v`` for one query position per sequence, as two batched matmuls.

    ``q`` is ``[G, kv_heads, group, D]`` (the query heads sharing a KV head are its rows),
    ``k`` and ``v`` ``[G, kv_heads, S, D]``, ``mask`` additive and broadcastable to
    ``[G, kv_heads, group, S]`` with at least one visible key per row. Scores are
    softmaxed in float32; in bfloat16 they are rounded to bfloat16 before scaling, as in
    transformers' eager attention. The scores are computed as ``k q^T`` (keys as the
    row-major operand), which streams the keys faster than ``q k^T`` on CPU
    (docs/performance.md, "Decode attention score order").
    """
    scores = torch.matmul(k, q.transpose(-1, -2)).transpose(-1, -2).contiguous().float().mul_(scale).add_(mask)
    return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)


def _gather(
    k_pool: torch.Tensor, v_pool: torch.Tensor, group: AttentionGroup, buffers: GatherBuffers, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of ``group.pages`` (``[G, n]``) as ``[G, kv_heads, n * page_tokens, head_dim]`` in
    ``dtype``: views of the pool for a ``page_run``, else gathered into ``buffers``."""
    pages = group.pages
    num_seqs, num_pages = pages.shape
    _, page_tokens, kv_heads, head_dim = k_pool.shape
    if group.page_run is not None:
        run = slice(group.page_run, group.page_run + num_pages)
        shape = (1, num_pages * page_tokens, kv_heads, head_dim)
        return k_pool[run].view(shape).transpose(1, 2).to(dtype), v_pool[run].view(shape).transpose(1, 2).to(dtype)
    k_rows, v_rows = buffers.take(num_seqs * num_pages, k_pool)
    gather_pages(k_pool, v_pool, pages, k_rows, v_rows)
    shape = (num_seqs, num_pages * page_tokens, kv_heads, head_dim)
    return k_rows.view(shape).transpose(1, 2).to(dtype), v_rows.view(shape).transpose(1, 2).to(dtype)
