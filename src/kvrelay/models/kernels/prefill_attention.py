"""Prefill attention on CPU: query blocks over only the keys they can see, as plain matmuls.

One prefilling sequence's ``Q`` new queries attend over a gathered window of its
keys. ``torch``'s fused CPU attention (``scaled_dot_product_attention``) with an
explicit mask scores every (query, key) pair of that window, and its GEMMs run
far below what the machine's matmuls reach (about 70 GFLOP/s against 400 for a
bfloat16 ``torch.mm`` through oneDNN on two AVX-512 cores; figures in
docs/performance.md, "Prefill attention").

``prefill_attention`` instead splits the queries into blocks of ``QUERY_BLOCK``
and, per block and KV head, attends over the keys the block can see: from the
first key the window lets its first query see, to its last query. The query
heads sharing a KV head are folded into the rows of one matrix, so a block is
two 2-D matmuls (scores, then probabilities times values) and a softmax. Only
the ragged edges of the block's key range (the causal diagonal; in sliding
layers, the window's start) get an additive mask; keys every query of the
block sees get none. Keys outside every query's view are never touched, so a
sliding layer costs ``O(window)`` keys per query, a full one ``O(position)``.

Numerics follow the fused kernel's: scores are ``(q * scale) k^T`` with float32
products and sums (bfloat16 inputs are widened first), softmaxed in float32;
the probabilities are rounded to the values' dtype for the second matmul (the
fused kernel rounds them too), which accumulates in float32. Only the order of
float summation differs.

Which of the two runs depends on the CPU (``prefill_kernel``): on AVX-512
without AMX block-wise took a 4,096-token cold prefill of Gemma 3 270M from
5.12 to 4.30 s, but on a Xeon with AMX the fused kernel's bfloat16 tiles beat
block-wise's float32 scores (0.43 against 1.01 s of attention in a 1.34
against 1.97 s prefill; ``bench/prefill_attention.py``), so
``prefill_kernel`` picks the fused kernel for bfloat16 where the CPU has AMX
tiles. ``prefill_attention_auto`` takes kvrelay's own C kernel of that kind
first (``native.prefill_attention``: only the key blocks a query sees): on AMX
tiles where the kind is fused, with AVX-512 BF16 dot products where it is
block-wise (a 4,096-token cold prefill 3.18 against 4.06 s on the EPYC);
torch's path where it does not load or apply. The rule is the hardware's, not
a timing's: every worker on a machine computes a prompt's KV with the same
kernel, which exact continuations rely on (docs/design.md section 8).

vLLM's CPU backend (vllm/v1/attention/backends/cpu_attn.py) attends a fresh
prompt with one fused ``scaled_dot_product_attention`` per sequence, and every
other prefill through its own kernel (``cpu_attention_with_kv_cache``,
csrc/cpu/cpu_attn_impl.hpp), which gathers the query heads of a KV head into
one tile of queries and bounds each tile's key range by the causal and
sliding-window limits; this module does the same with plain ``torch`` ops.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn.functional as F

from kvrelay.models.kernels.native.prefill_attention import NativePrefill, native_prefill_attention

log = logging.getLogger(__name__)

QUERY_BLOCK = 128
"""Queries per block: each block attends over its own key range, so smaller blocks skip more
masked keys (a sliding block sees ``window - 1 + QUERY_BLOCK`` keys at most) but make smaller
matmuls (figures: docs/performance.md, "Prefill attention")."""
FUSED_QUERY_BLOCK = 256
"""Queries per call of the fused kernel: a 512-query chunk of a sliding layer scores 25 % fewer (query, key)
pairs in two blocks than in one; blocks of 128 were slower again (docs/performance.md, "Prefill attention")."""


@dataclass(frozen=True, slots=True)
class PrefillSpan:
    """Where one prefilling sequence's queries and gathered keys sit.

    Query ``j`` is at position ``first_query + j``; gathered key ``i`` at ``first_key + i``.
    A query at ``p`` sees the key at ``k`` iff ``k <= p`` and, with a ``window``,
    ``k > p - window``.
    """

    first_query: int
    first_key: int
    window: int | None

    def block(self, start: int, stop: int) -> tuple[int, int, int]:
        """The positions of queries ``start..stop-1``: the first, the last, and the first key any of them sees."""
        first, last = self.first_query + start, self.first_query + stop - 1
        return first, last, max(self.first_key, 0 if self.window is None else first - self.window + 1)


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, span: PrefillSpan, scale: float, block: int = QUERY_BLOCK
) -> torch.Tensor:
    """Attention output ``[Q, heads, D]`` of queries ``q`` (``[Q, heads, D]``) over ``k``, ``v`` (``[kv_heads, S, D]``).

    The keys must cover every position a query sees: from
    ``max(0, first_query - window + 1)`` (``0`` without a window) to ``first_query + Q - 1``.
    """
    queries, heads, head_dim = q.shape
    kv_heads = k.shape[0]
    group = heads // kv_heads
    out = torch.empty_like(q)
    keys = _dense_float(k)  # _scores needs row-dense keys: see there
    for h in range(kv_heads):
        rows_of_head = q[:, h * group : (h + 1) * group]
        for start in range(0, queries, block):
            stop = min(queries, start + block)
            first, last, lo = span.block(start, stop)
            hi = last + 1
            rows = rows_of_head[start:stop].reshape(-1, head_dim).float() * scale
            scores = _scores(rows, keys[h, lo - span.first_key : hi - span.first_key])
            _mask_edges(scores.view(stop - start, group, hi - lo), first, last, lo, span.window)
            probs = torch.softmax(scores, dim=-1).to(v.dtype)
            attended = torch.mm(probs, v[h, lo - span.first_key : hi - span.first_key])
            out[start:stop, h * group : (h + 1) * group] = attended.view(stop - start, group, head_dim)
    return out


def _dense_float(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32 and contiguous, in one copy at most (``Tensor.to`` keeps a permuted layout)."""
    if t.dtype == torch.float32 and t.is_contiguous():
        return t
    return torch.empty(t.shape, dtype=torch.float32, device=t.device).copy_(t)


def _scores(rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``rows keys^T`` in float32: through oneDNN on CPU, else ``torch.mm``.

    ``torch.mm`` in float32 calls MKL, whose thread count does not follow the
    device thread's own pool (``worker.runtime.torch_threads.own_pool``), so inside
    the runtime it ran at a fraction of the speed it has on the main thread;
    oneDNN's linear uses the calling thread's OpenMP pool (figures:
    docs/performance.md, "Prefill attention"). ``keys`` must be row-dense (row stride
    = its width): for a strided weight oneDNN falls back to its reference inner product,
    ~250 times slower (a key window of several KV heads sliced from ``[S, kv_heads, D]``).
    """
    if rows.device.type == "cpu" and _ONEDNN_LINEAR is not None:
        return _ONEDNN_LINEAR(rows, keys, None, "none", [], "")
    return torch.mm(rows, keys.t())


_ONEDNN_LINEAR = (
    getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
    if torch.backends.mkldnn.is_available()
    else None
)


def _mask_edges(scores: torch.Tensor, first: int, last: int, lo: int, window: int | None) -> None:
    """Add ``-inf`` to ``scores`` (``[B, group, keys]``, key ``i`` at position ``lo + i``, queries at
    ``first..last``) where a query does not see a key, touching only the columns some query does not see."""
    hi = lo + scores.shape[-1]
    seen_by_all_from = lo if window is None else max(lo, last - window + 1)
    seen_by_all_to = first + 1
    if seen_by_all_from >= seen_by_all_to:
        ragged = [(lo, hi)]
    else:
        ragged = [(lo, seen_by_all_from), (seen_by_all_to, hi)]
    q_pos = torch.arange(first, last + 1).unsqueeze(1)
    for a, b in ragged:
        if a >= b:
            continue
        k_pos = torch.arange(a, b).unsqueeze(0)
        hidden = k_pos > q_pos
        if window is not None:
            hidden |= k_pos <= q_pos - window
        mask = torch.zeros(hidden.shape, dtype=scores.dtype).masked_fill_(hidden, float("-inf"))
        scores[:, :, a - lo : b - lo] += mask.unsqueeze(1)


def fused_prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, span: PrefillSpan, scale: float, block: int = FUSED_QUERY_BLOCK
) -> torch.Tensor:
    """What ``prefill_attention`` returns, from ``scaled_dot_product_attention``: ``is_causal`` for a chunk from
    position 0 that the window does not bind, else one call per ``block`` queries over the keys that block sees,
    with an additive mask (``_visibility_mask``)."""
    queries, heads, head_dim = q.shape
    qs = q.transpose(0, 1).unsqueeze(0)
    if span.first_query == 0 and span.first_key == 0 and (span.window is None or queries <= span.window):
        out = F.scaled_dot_product_attention(
            qs, k[None, :, :queries], v[None, :, :queries], is_causal=True, scale=scale, enable_gqa=True
        )
        return out[0].transpose(0, 1).reshape(queries, heads, head_dim)
    blocks = []
    for start in range(0, queries, block):
        stop = min(queries, start + block)
        first, last, lo = span.block(start, stop)
        keys = slice(lo - span.first_key, last + 1 - span.first_key)
        mask = _visibility_mask(stop - start, first, last + 1 - lo, lo, span.window, q.dtype)
        blocks.append(
            F.scaled_dot_product_attention(
                qs[:, :, start:stop], k[None, :, keys], v[None, :, keys], attn_mask=mask, scale=scale, enable_gqa=True
            )
        )
    out = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=2)
    return out[0].transpose(0, 1).reshape(queries, heads, head_dim)


@functools.lru_cache(maxsize=32)
def _visibility_mask(
    queries: int, first: int, keys: int, lo: int, window: int | None, dtype: torch.dtype
) -> torch.Tensor:
    """The additive mask (0 seen, ``-inf`` not) of queries at ``first..first+queries-1`` over keys at
    ``lo..lo+keys-1``. Cached: every layer of one attention kind asks for the same mask in a forward. Read-only."""
    q_pos = torch.arange(first, first + queries).unsqueeze(1)
    k_pos = torch.arange(lo, lo + keys).unsqueeze(0)
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    return torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))


class PrefillKernel(Enum):
    """The two ways to attend a prefill chunk on CPU (see the module docstring)."""

    BLOCKWISE = "blockwise"
    FUSED = "fused"


KERNELS = {PrefillKernel.BLOCKWISE: prefill_attention, PrefillKernel.FUSED: fused_prefill_attention}


@functools.cache
def prefill_kernel(dtype: torch.dtype) -> PrefillKernel:
    """``FUSED`` for bfloat16 on a CPU with AMX tiles (torch's fused kernel runs its bfloat16 products there),
    else ``BLOCKWISE``."""
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    chosen = PrefillKernel.FUSED if dtype == torch.bfloat16 and amx else PrefillKernel.BLOCKWISE
    log.info(
        "prefill attention for %s: %s (AMX tiles: %s%s)",
        dtype,
        chosen.value,
        amx,
        "; kvrelay's AMX kernel first where it loads"
        if chosen is PrefillKernel.FUSED
        else "; kvrelay's AVX-512 BF16 kernel first where it loads",
    )
    return chosen


def native_kernel(kind: PrefillKernel) -> NativePrefill:
    """The C kernel ``prefill_attention_auto`` tries first where torch's path would be ``kind``."""
    return NativePrefill.AMX if kind is PrefillKernel.FUSED else NativePrefill.AVX512


def prefill_attention_auto(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, span: PrefillSpan, scale: float
) -> torch.Tensor:
    """``prefill_attention`` through the kernel this CPU runs faster for ``q``'s dtype (``prefill_kernel``), and
    first through kvrelay's own C kernel of that kind where it loads and applies (``native.prefill_attention``:
    it scores only the 32-key blocks some of 32 rows sees): on AMX tiles where that is ``FUSED``, with AVX-512
    BF16 dot products where it is ``BLOCKWISE``."""
    kernel = prefill_kernel(q.dtype)
    out = native_prefill_attention(native_kernel(kernel), q, k, v, span.first_query, span.first_key, span.window, scale)
    if out is not None:
        return out
    return KERNELS[kernel](q, k, v, span, scale)
