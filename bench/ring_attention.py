"""Decode attention of one 32-lane step of Gemma 3 270M: the C kernel against the PyTorch path.

Two shapes, bfloat16, 4 query heads per KV head, head dim 256, keys laid out as
the runtime keeps them:

- ``rings``: the 15 sliding layers' rings, 32 lanes x 512 keys each (252 MB of keys
  and values), visible counts as after prompts of 128 to 1,024 tokens;
- ``full``: the 3 full layers' kept windows of those lanes, 1,152 keys each.

Each figure is the best (and the median) of ``--repeats`` passes over all the
layers of a shape, cold in cache between layers as in a real step (the read
rate counts the visible keys and values, which is what the kernel reads; the
PyTorch path reads the masked ones too); the baseline
is ``decode_attention`` (two batched matmuls and a float32 softmax) on the same
tensors in the same run, with the additive mask the runtime builds for it.

Run: ``.venv/bin/python bench/ring_attention.py --json bench-ring.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from kvrelay.bench.report import Figure, report
from kvrelay.models.kernels.attention import decode_attention
from kvrelay.models.kernels.native.attention import decode_attention_native

LANES, HEADS, HEAD_DIM = 32, 4, 256
SHAPES = {"rings": (15, 512), "full": (3, 1152)}


def timed(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(best, median) seconds of ``repeats`` calls of ``fn`` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def over_layers(
    attend: Callable[..., object], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, limit: torch.Tensor, scale: float
) -> Callable[[], None]:
    """One pass of ``attend`` over every layer of ``k`` and ``v`` (``[layers, lanes, 1, keys, dim]``)."""

    def run() -> None:
        for layer in range(k.shape[0]):
            attend(q, k[layer], v[layer], limit, scale)

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lanes", type=int, default=LANES)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    scale = HEAD_DIM**-0.5
    figures = []
    for name, (layers, keys) in SHAPES.items():
        k = torch.randn(layers, args.lanes, 1, keys, HEAD_DIM, generator=gen).bfloat16()
        v = torch.randn(layers, args.lanes, 1, keys, HEAD_DIM, generator=gen).bfloat16()
        q = torch.randn(args.lanes, 1, HEADS, HEAD_DIM, generator=gen).bfloat16()
        lengths = torch.randint(128 + 64, 1024 + 64, (args.lanes,), generator=gen)
        visible = lengths.clamp(max=keys)
        hidden = torch.arange(keys) >= visible.view(-1, 1, 1, 1)
        mask = torch.zeros(hidden.shape, dtype=torch.bfloat16).masked_fill_(hidden, float("-inf"))
        visible_bytes = 2 * layers * int(visible.sum()) * HEAD_DIM * k.element_size()
        if decode_attention_native(q, k[0], v[0], visible, scale) is None:
            print("the native kernel does not run here (no AVX-512 BF16, no C compiler, or turned off)")
            return 1

        kernel = over_layers(decode_attention_native, q, k, v, visible, scale)
        pytorch = over_layers(decode_attention, q, k, v, mask, scale)
        best_kernel, median_kernel = timed(kernel, args.repeats)
        best_torch, median_torch = timed(pytorch, args.repeats)
        baseline = "decode_attention (PyTorch)"
        figures += [
            Figure(f"{name}_{layers}_layers_best_ms", best_kernel * 1e3, "ms", baseline, best_torch * 1e3),
            Figure(f"{name}_{layers}_layers_median_ms", median_kernel * 1e3, "ms", baseline, median_torch * 1e3),
            Figure(f"{name}_speedup_best", best_torch / best_kernel, "x", baseline, 1.0),
            Figure(f"{name}_speedup_median", median_torch / median_kernel, "x", baseline, 1.0),
            Figure(
                f"{name}_visible_read_gb_per_s",
                visible_bytes / median_kernel / 1e9,
                "GB/s",
                baseline,
                visible_bytes / median_torch / 1e9,
            ),
        ]
    report(f"decode attention, {args.lanes} lanes, {args.threads} threads, bfloat16", figures, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
