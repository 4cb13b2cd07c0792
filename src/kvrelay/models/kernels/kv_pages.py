"""The paged KV pool a model reads and writes (docs/design.md section 8).

A token at absolute position ``p`` of a sequence whose page table is ``T`` has
its key and value at ``k[layer, T[p // page_tokens], p % page_tokens]`` (and the
same index into ``v``). Pages are allocated zero-filled, so every slot holds a
finite value: attention masks unused slots, and a masked finite value adds
exactly nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrelay.models.config import ModelConfig
from kvrelay.models.kernels.huge_pages import huge_page_zeros


@dataclass(frozen=True, slots=True)
class KVPages:
    """Keys and values of every layer, shaped ``[num_layers, num_pages, page_tokens, num_kv_heads, head_dim]``."""

    k: torch.Tensor
    v: torch.Tensor

    def __post_init__(self) -> None:
        if self.k.shape != self.v.shape or self.k.dim() != 5:
            raise ValueError(
                f"KVPages needs k and v of one 5-d shape [layers, pages, page_tokens, kv_heads, head_dim]; "
                f"got k {tuple(self.k.shape)} and v {tuple(self.v.shape)}"
            )

    @classmethod
    def allocate(
        cls,
        config: ModelConfig,
        num_pages: int,
        page_tokens: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> KVPages:
        """A zero-filled pool of ``num_pages`` pages of ``page_tokens`` tokens for ``config`` (CPU: on huge pages)."""
        if num_pages < 1 or page_tokens < 1:
            raise ValueError(f"KVPages needs num_pages >= 1 and page_tokens >= 1; got {num_pages}, {page_tokens}")
        shape = (config.num_layers, num_pages, page_tokens, config.num_kv_heads, config.head_dim)
        return cls(
            k=huge_page_zeros(shape, dtype, device),
            v=huge_page_zeros(shape, dtype, device),
        )

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def page_tokens(self) -> int:
        return self.k.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def device(self) -> torch.device:
        return self.k.device

    def page_bytes(self) -> int:
        """Bytes one page occupies across all layers, keys and values together."""
        per_layer_page = self.k[0, 0].numel() * self.k.element_size()
        return 2 * self.num_layers * per_layer_page


def gather_pages(
    k_pool: torch.Tensor, v_pool: torch.Tensor, pages: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor
) -> None:
    """Copy ``pages`` (``[G, n]``) of one layer's pools (``[pages, page_tokens, kv_heads, head_dim]``) into
    ``k_out`` and ``v_out``: contiguous, of the pool's dtype, ``G * n`` pages long, in ``pages``' order."""
    flat = pages.flatten()
    torch.index_select(k_pool.flatten(1), 0, flat, out=k_out.view(flat.shape[0], -1))
    torch.index_select(v_pool.flatten(1), 0, flat, out=v_out.view(flat.shape[0], -1))


def write_kv(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_run: int | None = None,
) -> None:
    """Store new keys and values (``[T, kv_heads, head_dim]``) of one layer at ``slots`` of its pool; where
    the slots are consecutive from ``slot_run``, as one slice copy (a prefill chunk in consecutive pages: an
    indexed copy of strided rows took three times as long)."""
    k_rows, v_rows = k_pool.view(-1, *k_pool.shape[2:]), v_pool.view(-1, *v_pool.shape[2:])
    if slot_run is not None:
        k_rows[slot_run : slot_run + k.shape[0]].copy_(k)
        v_rows[slot_run : slot_run + v.shape[0]].copy_(v)
        return
    k_rows.index_copy_(0, slots, k.to(k_pool.dtype))
    v_rows.index_copy_(0, slots, v.to(v_pool.dtype))
