"""Smoke runs of the ``bench/`` scripts: load one as a module and run its ``main`` on tiny arguments."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import torch

BENCH_DIR = Path(__file__).parents[2] / "bench"


def run_bench(script: str, argv: list[str], out: Path) -> tuple[int, list[dict[str, Any]]]:
    """``bench/<script>``'s ``main(argv + ["--json", out])``, with torch's thread count restored after it;
    its exit code and the figures it wrote (``[]`` when it wrote none)."""
    spec = importlib.util.spec_from_file_location(f"bench_{Path(script).stem}", BENCH_DIR / script)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # so a process pool can pickle the bench's functions by name
    spec.loader.exec_module(bench)
    threads = torch.get_num_threads()
    try:
        code = bench.main([*argv, "--json", str(out)])
    finally:
        torch.set_num_threads(threads)
    return code, json.loads(out.read_text()) if out.exists() else []
