"""One row through Gemma 3 270M's LM head on 2 MiB huge pages against ordinary 4 KiB pages.

``lm_head_row``: one row through the tied LM head (``--vocab`` 262,144 rows of
640, bfloat16), as at the end of every prefill, through ``PackedLinear`` (the C
GEMV where it is built, else ``F.linear``), with the weights in a tensor from
``huge_pages.huge_page_empty`` and in a plain ``torch.empty`` of the same shape,
in the same run. Before each call, ``--evict-mib`` (64) MiB of other memory are
written, as a prefill's activations would, so that neither the weights nor
their page tables start in cache.

Each figure is the best and the median of ``--repeats`` calls. The table also
says what the kernel granted: the huge pages backing the huge-page tensor
(``AnonHugePages`` of its mapping) and the system's THP setting.

Run: ``.venv/bin/python bench/huge_pages.py --json bench-huge-pages.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvrelay.bench.report import Figure, report
from kvrelay.models.kernels.huge_pages import huge_page_empty
from kvrelay.models.mlp import PackedLinear

HIDDEN = 640
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def timed(fn: Callable[[], object], before: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(best, median) seconds of ``repeats`` calls of ``fn``, each after an untimed ``before()``."""
    fn()
    times = []
    for _ in range(repeats):
        before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def huge_kib(tensor: torch.Tensor) -> int:
    """``AnonHugePages`` (KiB) of the mappings that hold ``tensor``'s data; -1 where smaps cannot be read."""
    lo, hi = tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes
    total, inside = 0, False
    try:
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    start, end = (int(part, 16) for part in head.split("-"))
                    inside = start < hi and lo < end
                elif inside and head == "AnonHugePages:":
                    total += int(line.split()[1])
    except OSError:
        return -1
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=262144, help="rows of the LM head")
    parser.add_argument("--evict-mib", type=int, default=64, help="memory written before each call")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    source = torch.randn(args.vocab, HIDDEN, generator=gen).bfloat16()
    huge = huge_page_empty(tuple(source.shape), torch.bfloat16).copy_(source)
    plain = torch.empty(source.shape, dtype=torch.bfloat16).copy_(source)
    del source
    row = torch.randn(1, HIDDEN, generator=gen).bfloat16()
    other = torch.empty(args.evict_mib << 18, dtype=torch.float32)

    def evict() -> None:
        other.add_(1.0)

    results: dict[str, dict[str, tuple[float, float]]] = {}
    for label, weight in (("huge", huge), ("plain", plain)):
        head = PackedLinear(weight, max_rows=None)
        results[label] = {"lm_head_row": timed(lambda head=head: head(row), evict, args.repeats)}
    baseline = "ordinary 4 KiB pages"
    figures = []
    for name in results["huge"]:
        (best, median), (plain_best, plain_median) = results["huge"][name], results["plain"][name]
        figures += [
            Figure(f"{name}_best_ms", best * 1e3, "ms", baseline, plain_best * 1e3),
            Figure(f"{name}_median_ms", median * 1e3, "ms", baseline, plain_median * 1e3),
            Figure(
                f"{name}_read_gb_per_s", huge.nbytes / median / 1e9, "GB/s", baseline, plain.nbytes / plain_median / 1e9
            ),
        ]
    figures.append(Figure("huge_pages_granted_mib", huge_kib(huge) / 1024, "MiB", "tensor size", huge.nbytes / 2**20))
    setting = THP_SETTING.read_text().strip() if THP_SETTING.exists() else "absent"
    report(
        f"{args.vocab} x {HIDDEN} bfloat16 weights, {args.threads} threads, THP setting: {setting}",
        figures,
        args.json,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
