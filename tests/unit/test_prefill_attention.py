"""Block-wise and fused prefill attention equal the masked attention; the engine takes the one its CPU runs faster.

Random queries, keys and values; every combination of full and sliding layers,
chunks with and without keys before them, GQA and not, and query blocks that
split the chunk unevenly (so block edges fall on the diagonal and the window's
start). The reference is attention by its definition, in float64.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from kvrelay.models.kernels import prefill_attention as prefill_attention_module
from kvrelay.models.kernels.prefill_attention import (
    PrefillKernel,
    PrefillSpan,
    fused_prefill_attention,
    prefill_attention,
    prefill_attention_auto,
    prefill_kernel,
)
from tests.support.masked_attention import SCALE, masked_attention
from tests.support.torch_threads import one_thread  # noqa: F401  (autouse: torch on one thread)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 1), (4, 2), (3, 3)])
@pytest.mark.parametrize("window", [None, 6, 23])
@pytest.mark.parametrize(("first_query", "first_key"), [(0, 0), (13, 0), (40, 16), (41, 40)])
@pytest.mark.parametrize("block", [1, 5, 8, 64])
def test_blockwise_prefill_equals_masked_attention(
    dtype: torch.dtype, heads: int, kv_heads: int, window: int | None, first_query: int, first_key: int, block: int
) -> None:
    queries = 19
    seed = zlib.crc32(repr((dtype, heads, kv_heads, window, first_query, first_key, block)).encode())
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    first_key = min(first_key, 0 if window is None else max(0, first_query - window + 1))
    keys = first_query + queries - first_key
    q = torch.randn(queries, heads, 8, generator=gen).to(dtype)
    k = torch.randn(kv_heads, keys, 8, generator=gen).to(dtype)
    v = torch.randn(kv_heads, keys, 8, generator=gen).to(dtype)
    span = PrefillSpan(first_query, first_key, window)
    got = prefill_attention(q, k, v, span, SCALE, block)
    want = masked_attention(q, k, v, span)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance)
    fused = fused_prefill_attention(q, k, v, span, SCALE, block)
    torch.testing.assert_close(fused.float(), want.float(), rtol=tolerance, atol=tolerance)


def test_keys_outside_every_querys_view_are_never_read() -> None:
    """Keys before a sliding window's reach and past the last query may hold anything, even NaN."""
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(10, 2, 8, generator=gen)
    k = torch.randn(1, 40, 8, generator=gen)
    v = torch.randn(1, 40, 8, generator=gen)
    span = PrefillSpan(first_query=20, first_key=0, window=5)
    want = prefill_attention(q, k[:, :30], v[:, :30], span, SCALE, block=3)
    fused = fused_prefill_attention(q, k[:, :30], v[:, :30], span, SCALE, block=3)
    k[:, :16], v[:, :16] = float("nan"), float("nan")
    k[:, 30:], v[:, 30:] = float("nan"), float("nan")
    assert torch.equal(prefill_attention(q, k, v, span, SCALE, block=3), want)
    assert torch.equal(fused_prefill_attention(q, k, v, span, SCALE, block=3), fused)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keys_of_several_kv_heads_reach_the_score_matmul_row_dense(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The paged gather hands keys as a view ``[S, kv_heads, D]`` permuted to ``[kv_heads, S, D]``; a head's
    slice of it has a row stride of ``kv_heads * D``, and oneDNN runs such a weight through its reference
    inner product (``kvrelay generate`` of 8 tokens after 384 on a 6-layer float32 Llama: 73 s, 2.7 s dense)."""
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(12, 4, 8, generator=gen).to(dtype)
    k = torch.randn(12, 2, 8, generator=gen).to(dtype).permute(1, 0, 2)
    v = torch.randn(12, 2, 8, generator=gen).to(dtype).permute(1, 0, 2)
    span = PrefillSpan(0, 0, None)
    seen: list[tuple[int, ...]] = []
    real = prefill_attention_module._scores

    def scores(rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        seen.append(keys.stride())
        return real(rows, keys)

    monkeypatch.setattr(prefill_attention_module, "_scores", scores)
    got = prefill_attention(q, k, v, span, SCALE, block=4)
    assert seen and all(stride == (8, 1) for stride in seen), seen
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), masked_attention(q, k, v, span).float(), rtol=tolerance, atol=tolerance)


def test_the_kernel_follows_the_cpu_and_the_dtype() -> None:
    amx = torch.cpu._is_amx_tile_supported()
    assert prefill_kernel(torch.float32) is PrefillKernel.BLOCKWISE
    assert prefill_kernel(torch.bfloat16) is (PrefillKernel.FUSED if amx else PrefillKernel.BLOCKWISE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_engine_attends_through_the_kernel_of_its_dtype(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(19, 4, 8, generator=gen).to(dtype)
    k = torch.randn(1, 40, 8, generator=gen).to(dtype)
    v = torch.randn(1, 40, 8, generator=gen).to(dtype)
    span = PrefillSpan(first_query=21, first_key=0, window=None)
    kernel = prefill_attention if prefill_kernel(dtype) is PrefillKernel.BLOCKWISE else fused_prefill_attention
    assert torch.equal(prefill_attention_auto(q, k, v, span, SCALE), kernel(q, k, v, span, SCALE))
