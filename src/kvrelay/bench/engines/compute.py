"""The compute limit of a decode: the machine's measured bfloat16 peak over the model's FLOPs per token.

``flops_per_token(config, context)`` counts the multiply-adds of one token (two FLOPs each): every projection
of every layer, the LM head, and attention's scores and weighted values over the keys it sees at ``context``
(its sliding window in sliding layers, all of them in full ones). Norms, rope and activations are left out
(under 1 %).

``prefill_flops(config, tokens)`` is a cold prefill's: every token's projections and causal attention (the
token at position ``i`` sees ``i`` keys, or its window), and the LM head for the last token only. Over the
peak it is the least time any runtime can take to a first token on this machine (the compute floor).

``peak_flops(threads)`` is ``threads`` times the best rate, in FLOP per second of CPU time, of a square
bfloat16 GEMM on one torch thread, taken as torch's bfloat16 ``matmul`` or as a float32 ``matmul`` of the same
(exactly representable) values, whichever is faster: a CPU without bfloat16 instructions (AVX2) multiplies
bfloat16 numbers fastest as float32, and a bfloat16 GEMM accumulates in float32 anyway. CPU time, not wall
time: on a shared machine the wall clock also counts the time the OS gives other processes, and the peak is
what the cores deliver while they run. The limit in tokens per second is ``peak / flops_per_token``; a
decode's share of it is its rate over that.

One stream is bound by memory, not compute: ``bytes_per_token(config, context, head_bytes)`` counts what one
token's step must read (every projection weight in bfloat16, the LM head at ``head_bytes`` per row, and the keys
and values the attention sees at ``context``), and ``read_rate(threads)`` is the best rate at which ``threads``
torch threads sum a tensor larger than the last-level cache. Their quotient is the fastest one stream can decode
on this machine without reading fewer bytes (the bandwidth floor).
"""

from __future__ import annotations

import time

import torch

from kvrelay.models.config import ModelConfig


def flops_per_token(config: ModelConfig, context: float) -> float:
    """FLOPs of one token at ``context`` positions (see the module docstring)."""
    hidden, inner, d = config.hidden_size, config.intermediate_size, config.head_dim
    heads, kv_heads = config.num_heads, config.num_kv_heads
    per_layer = hidden * (heads + 2 * kv_heads) * d + heads * d * hidden + 3 * hidden * inner
    macs = float(config.num_layers * per_layer + config.vocab_size * hidden)
    window = config.sliding_window or 0
    for kind in config.layer_types:
        seen = min(context, window) if kind == "sliding_attention" and window else context
        macs += 2 * heads * d * seen
    return 2.0 * macs


def prefill_flops(config: ModelConfig, tokens: int) -> float:
    """FLOPs of a cold prefill of ``tokens`` positions (see the module docstring)."""
    hidden, inner, d = config.hidden_size, config.intermediate_size, config.head_dim
    heads, kv_heads = config.num_heads, config.num_kv_heads
    per_layer = hidden * (heads + 2 * kv_heads) * d + heads * d * hidden + 3 * hidden * inner
    macs = float(tokens * config.num_layers * per_layer + config.vocab_size * hidden)
    window = config.sliding_window or 0
    for kind in config.layer_types:
        if kind == "sliding_attention" and window and tokens > window:
            seen = window * (window + 1) / 2 + (tokens - window) * window
        else:
            seen = tokens * (tokens + 1) / 2
        macs += 2 * heads * d * seen
    return 2.0 * macs


def peak_flops(threads: int, size: int = 1024, repeats: int = 5) -> tuple[float, str]:
    """``threads`` times the best FLOP per CPU second of a ``size``-square bfloat16 GEMM on one thread, and how it
    was reached (``"bfloat16"`` or ``"float32"``; see the module docstring)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        probe = {dtype: _best_seconds(512, dtype, 1) for dtype in _DTYPES}
        fastest = min(probe.values())
        best = {dtype: _best_seconds(size, dtype, repeats) for dtype, s in probe.items() if s <= 2 * fastest}
    finally:
        torch.set_num_threads(previous)
    dtype = min(best, key=lambda k: best[k])
    return threads * 2.0 * size**3 / best[dtype], str(dtype).removeprefix("torch.")


def bytes_per_token(config: ModelConfig, context: float, head_bytes: float) -> float:
    """Bytes one stream's decode step reads at ``context`` positions, the head at ``head_bytes`` per vocabulary
    row (see the module docstring)."""
    hidden, inner, d = config.hidden_size, config.intermediate_size, config.head_dim
    per_layer = hidden * (config.num_heads + 2 * config.num_kv_heads) * d + config.num_heads * d * hidden
    per_layer += 3 * hidden * inner
    window = config.sliding_window or 0
    kv = 0.0
    for kind in config.layer_types:
        seen = min(context, window) if kind == "sliding_attention" and window else context
        kv += 2 * config.num_kv_heads * d * seen * 2
    return config.num_layers * per_layer * 2.0 + config.vocab_size * head_bytes + kv


def read_rate(threads: int, mib: int = 1024, repeats: int = 5) -> float:
    """The best rate, in bytes per second, at which ``threads`` torch threads sum ``mib`` MiB of float32."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        data = torch.ones(mib * 2**18)
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            data.sum()
            best = min(best, time.perf_counter() - started)
    finally:
        torch.set_num_threads(previous)
    return data.numel() * 4 / best


_DTYPES = (torch.bfloat16, torch.float32)
"""The two ways to multiply bfloat16 numbers; a way more than twice slower on a small probe is not timed at full
size (a reference kernel would take minutes)."""


def _best_seconds(size: int, dtype: torch.dtype, repeats: int) -> float:
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=gen).to(torch.bfloat16).to(dtype) for _ in range(2))
    started = time.thread_time()
    a @ b  # first call: allocation and kernel choice
    best = time.thread_time() - started
    for _ in range(repeats if best < 2.0 else 0):
        started = time.thread_time()
        a @ b
        best = min(best, time.thread_time() - started)
    return best
