"""The runtime's bfloat16 projections against PyTorch's ``F.linear`` on this CPU, at Gemma 3 270M's shapes.

``PackedLinear`` is what the runtime runs: oneDNN-packed weights where the CPU has AVX-512 BF16, the panels of
``native.linear_avx2`` where it has only AVX2 (there ``F.linear`` in bfloat16 is PyTorch's generic loop; the
path taken is printed). For each row count (``--rows``: decode batches and a prefill chunk) it times one
decoder layer's projections (q/k/v fused, o, gate, up, down) and the 262,144-row tied LM head, both ways, on
``--threads`` torch threads, interleaved, and reports the medians of ``--repeats`` (wall clock; the machine is
shared, so the median, not the best). Random weights of the real shapes: the speed does not depend on the
values.

Run: ``.venv/bin/python bench/projections.py --json bench/results/projections.json``
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from statistics import median

import torch
import torch.nn.functional as F

from kvrelay.bench.report import Figure, report
from kvrelay.models.kernels.native.build import best_isa
from kvrelay.models.mlp import PackedLinear

HIDDEN, INNER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 640, 2048, 4, 1, 256, 262_144
LAYER = {
    "qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
    "o": (HIDDEN, HEADS * HEAD_DIM),
    "gate": (INNER, HIDDEN),
    "up": (INNER, HIDDEN),
    "down": (HIDDEN, INNER),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,32,512", help="row counts (default 1,8,32,512)")
    parser.add_argument("--head-rows", default="1,8,32", help="row counts of the LM head (default 1,8,32)")
    parser.add_argument("--vocab", type=int, default=VOCAB, help="LM head rows (default Gemma 3's 262,144)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    layer = {name: (torch.randn(shape, generator=gen) * 0.05).bfloat16() for name, shape in LAYER.items()}
    ours = {name: PackedLinear(w) for name, w in layer.items()}
    head_weight = (torch.randn(args.vocab, HIDDEN, generator=gen) * 0.05).bfloat16()
    head = PackedLinear(head_weight, max_rows=None)
    path = "avx2 panels" if head.panels is not None else ("oneDNN packed" if head.packed is not None else "F.linear")
    print(f"runtime path: {path} (kernels: {best_isa()}); {args.threads} threads", flush=True)
    figures: list[Figure] = []
    for rows in (int(r) for r in args.rows.split(",")):
        x = {name: (torch.randn(rows, w.shape[1], generator=gen)).bfloat16() for name, w in layer.items()}
        runtime, torch_ms = timed_pair(
            lambda x=x: [ours[n](x[n]) for n in LAYER],
            lambda x=x: [F.linear(x[n], layer[n]) for n in LAYER],
            args.repeats,
        )
        figures.append(Figure(f"layer_projections_{rows}_rows_ms", runtime, "ms", "F.linear bfloat16", torch_ms))
        print(f"one layer's projections, {rows} rows: {runtime:.2f} ms against {torch_ms:.2f} ms", flush=True)
    for rows in (int(r) for r in args.head_rows.split(",")):
        h = torch.randn(rows, HIDDEN, generator=gen).bfloat16()
        runtime, torch_ms = timed_pair(lambda h=h: head(h), lambda h=h: F.linear(h, head_weight), args.repeats)
        figures.append(Figure(f"lm_head_{rows}_rows_ms", runtime, "ms", "F.linear bfloat16", torch_ms))
        print(f"LM head, {rows} rows: {runtime:.1f} ms against {torch_ms:.1f} ms", flush=True)
    report(f"bfloat16 projections ({path}) against F.linear, {args.threads} threads, medians", figures, args.json)
    return 0


def timed_pair(ours: Callable[[], object], theirs: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Medians in ms of ``ours`` and ``theirs``, run alternately after one warm-up call each."""
    ours()
    theirs()
    a, b = [], []
    for _ in range(repeats):
        for fn, out in ((ours, a), (theirs, b)):
            started = time.perf_counter()
            fn()
            out.append((time.perf_counter() - started) * 1e3)
    return median(a), median(b)


if __name__ == "__main__":
    sys.exit(main())
