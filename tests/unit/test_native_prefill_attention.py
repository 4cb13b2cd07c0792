"""Prefill attention in C (on AMX tiles; with AVX-512 BF16 dot products) equals attention by its definition, row
by row whatever shares its tile; each kernel's tests run where it loads.

Random queries, keys and values in bfloat16; full and sliding layers, chunks with and
without keys before them, GQA and not, chunk lengths that end mid-tile. The reference
is float64 attention (``tests.support.masked_attention``); the kernel may differ from it
only by bfloat16 rounding, and by no more than torch's fused kernel does.
"""

from __future__ import annotations

import pytest
import torch

from kvrelay.models.kernels.native.prefill_attention import NativePrefill, native_prefill_attention
from kvrelay.models.kernels.prefill_attention import (
    PrefillSpan,
    fused_prefill_attention,
    native_kernel,
    prefill_attention_auto,
    prefill_kernel,
)
from tests.support.masked_attention import SCALE, masked_attention


@pytest.fixture(
    params=[
        pytest.param(
            kind,
            id=kind.value,
            marks=pytest.mark.skipif(kind.library() is None, reason=f"the {kind.value} kernel does not load here"),
        )
        for kind in NativePrefill
    ]
)
def kernel(request: pytest.FixtureRequest) -> NativePrefill:
    return request.param  # type: ignore[no-any-return]


def _inputs(
    seed: int, queries: int, heads: int, kv_heads: int, dim: int, keys: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q ``[Q, heads, D]``; k, v ``[kv_heads, S, D]`` as the engine gathers them (views of ``[S, kv_heads, D]``)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(queries, heads, dim, generator=gen).bfloat16()
    k = torch.randn(keys, kv_heads, dim, generator=gen).bfloat16().transpose(0, 1)
    v = torch.randn(keys, kv_heads, dim, generator=gen).bfloat16().transpose(0, 1)
    return q, k, v


def _run(kernel: NativePrefill, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, span: PrefillSpan) -> torch.Tensor:
    out = native_prefill_attention(kernel, q, k, v, span.first_query, span.first_key, span.window, SCALE)
    assert out is not None
    return out


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 1, 256), (4, 2, 64), (3, 3, 128)])
@pytest.mark.parametrize("window", [None, 37, 512])
@pytest.mark.parametrize(("first_query", "first_key", "queries"), [(0, 0, 1), (0, 0, 75), (600, 0, 43), (600, 200, 21)])
def test_the_kernel_equals_attention_by_its_definition(
    kernel: NativePrefill,
    heads: int,
    kv_heads: int,
    dim: int,
    window: int | None,
    first_query: int,
    first_key: int,
    queries: int,
) -> None:
    if window is not None:
        first_key = max(first_key, first_query - window + 1) if first_key else 0
    keys = first_query + queries - first_key
    q, k, v = _inputs(first_query + queries + dim, queries, heads, kv_heads, dim, keys)
    span = PrefillSpan(first_query, first_key, window)
    want = masked_attention(q.double(), k.double(), v.double(), span)
    got = _run(kernel, q, k, v, span)
    fused = fused_prefill_attention(q, k, v, span, SCALE)
    assert got.shape == q.shape and got.dtype == torch.bfloat16
    error = (got.double() - want).abs().max().item()
    assert error <= max(2e-2, 1.5 * (fused.double() - want).abs().max().item()), error


def test_a_rows_result_does_not_depend_on_the_rows_beside_it(kernel: NativePrefill) -> None:
    """The last 5 queries alone (a tile of their own) give the bits they got as the tail of 70 (other tile
    mates, another first key block), on one thread and on two."""
    q, k, v = _inputs(5, 70, 4, 1, 256, 700)
    span = PrefillSpan(630, 0, 300)
    whole = _run(kernel, q, k, v, span)
    tail = _run(kernel, q[65:], k, v, PrefillSpan(695, 0, 300))
    assert torch.equal(whole[65:], tail)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if before > 1 else 2)
        assert torch.equal(_run(kernel, q, k, v, span), whole)
    finally:
        torch.set_num_threads(before)


def test_keys_that_miss_a_query_are_refused_with_the_positions(kernel: NativePrefill) -> None:
    q, k, v = _inputs(1, 8, 4, 1, 64, 10)
    with pytest.raises(ValueError, match="8 queries from position 5 over 10 keys from position 0"):
        native_prefill_attention(kernel, q, k, v, 5, 0, None, SCALE)


def test_it_does_not_apply_where_the_kernel_cannot_run(kernel: NativePrefill) -> None:
    q, k, v = _inputs(2, 4, 4, 1, 64, 4)
    assert native_prefill_attention(kernel, q.float(), k.float(), v.float(), 0, 0, None, SCALE) is None
    assert native_prefill_attention(kernel, q[..., :32], k[..., :32], v[..., :32], 0, 0, None, SCALE) is None


def test_the_engine_attends_every_bfloat16_prefill_through_the_cpus_kernel() -> None:
    """Through the AMX kernel where torch's fused kernel is the CPU's kind (AMX tiles), else the AVX-512 one."""
    chosen = native_kernel(prefill_kernel(torch.bfloat16))
    if chosen.library() is None:
        pytest.skip(f"the {chosen.value} kernel does not load here")
    q, k, v = _inputs(3, 50, 4, 1, 256, 120)
    for span in (PrefillSpan(70, 0, 64), PrefillSpan(70, 0, None), PrefillSpan(0, 0, None)):
        keys = span.first_query + 50
        got = prefill_attention_auto(q, k[:, :keys], v[:, :keys], span, SCALE)
        assert torch.equal(got, _run(chosen, q, k, v, span))


def test_queries_may_be_rows_of_a_wider_projection(kernel: NativePrefill) -> None:
    """The engine's queries are a view of the q/k/v projection's rows: the same bits as a contiguous copy."""
    q, k, v = _inputs(4, 40, 4, 1, 64, 40)
    wide = torch.cat([q, torch.zeros(40, 2, 64, dtype=q.dtype)], dim=1)[:, :4]
    span = PrefillSpan(0, 0, 16)
    assert not wide.is_contiguous()
    assert torch.equal(_run(kernel, wide, k, v, span), _run(kernel, q, k, v, span))
