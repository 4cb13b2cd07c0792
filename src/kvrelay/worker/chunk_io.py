"""Copies between a chunk's KV pages and its stored form.

A chunk of ``chunk_tokens`` tokens spans ``chunk_tokens / page_tokens`` pages.
Its stored payload is one tensor ``[num_layers, 2 (K, V), chunk_tokens,
num_kv_heads, head_dim]`` in the KV dtype: the pages' K and V, in order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvrelay.models.kernels.kv_pages import KVPages


def gather_chunk(kv: KVPages, pages: Sequence[int]) -> torch.Tensor:
    """A new host tensor with the chunk's K and V (the staging copy of a checkpoint)."""
    index = torch.tensor(list(pages), device=kv.k.device)
    k = kv.k.index_select(1, index)
    v = kv.v.index_select(1, index)
    layers, n, page_tokens, heads, dim = k.shape
    out = torch.stack((k, v), dim=1).reshape(layers, 2, n * page_tokens, heads, dim)
    return out.to("cpu", copy=True) if out.device.type != "cpu" else out.contiguous()


def scatter_chunk(kv: KVPages, pages: Sequence[int], chunk: torch.Tensor) -> None:
    """Write a stored chunk tensor into ``pages`` (shape and dtype must match the pool's)."""
    layers, two, tokens, heads, dim = chunk.shape
    n = len(pages)
    expected = (kv.k.shape[0], 2, n * kv.page_tokens, kv.k.shape[3], kv.k.shape[4])
    if tuple(chunk.shape) != expected or chunk.dtype != kv.k.dtype:
        raise ValueError(
            f"chunk of shape {tuple(chunk.shape)} {chunk.dtype} does not fit pages shaped {expected} {kv.k.dtype}"
        )
    index = torch.tensor(list(pages), device=kv.k.device)
    paged = chunk.reshape(layers, 2, n, kv.page_tokens, heads, dim).to(kv.k.device)
    kv.k.index_copy_(1, index, paged[:, 0])
    kv.v.index_copy_(1, index, paged[:, 1])
