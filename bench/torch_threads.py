"""What a second thread's torch ops cost when another thread has opened a torch thread pool.

PyTorch's CPU build parallelises ops with OpenMP (libgomp), which gives every
OS thread that opens a parallel region its own team. The worker's device
thread runs the model while the main thread has usually loaded it, opening a
team of its own. This bench times ops on a second thread (as the device thread
is) in three fresh processes, torch at ``--threads``:

- ``alone``: the main thread never ran a torch op (the fast case, the baseline);
- ``main_parallel``: the main thread ran one parallel op first (what the server
  and ``bench/runtime.py`` do today);
- ``main_confined``: the main thread was set to one torch thread before its
  first op, then ran the same op serially.

Figures per case: a 40,960-element float32 add, a 2M-element multiply and a
32-row bfloat16 linear (640 -> 2048), microseconds per call (best of 3 rounds).

    .venv/bin/python bench/torch_threads.py [--threads 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from kvrelay.bench.report import Figure, report

CASES = ("alone", "main_parallel", "main_confined")

PROBE = r"""
import json, sys, threading, time, torch
case, threads = sys.argv[1], int(sys.argv[2])
torch.set_num_threads(threads)
if case != "alone":
    if case == "main_confined":
        torch.set_num_threads(1)
    x = torch.randn(4096, 4096)
    (x + x).sum()
out = {}
def timed(fn, n):
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best
def second_thread():
    torch.set_num_threads(threads)
    a, b = torch.randn(40960), torch.randn(40960)
    big = torch.randn(2_000_000)
    w = torch.randn(2048, 640, dtype=torch.bfloat16)
    h = torch.randn(32, 640, dtype=torch.bfloat16)
    out["add_us"] = timed(lambda: a + b, 2000)
    out["mul_2m_us"] = timed(lambda: big * 2, 100)
    out["linear_bf16_us"] = timed(lambda: torch.nn.functional.linear(h, w), 300)
t = threading.Thread(target=second_thread)
t.start()
t.join()
print(json.dumps(out))
"""


def probe(case: str, threads: int) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", PROBE, case, str(threads)], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    results = {case: probe(case, args.threads) for case in CASES}
    figures = []
    for op in results["alone"]:
        base = results["alone"][op]
        figures.append(Figure(f"{op}_alone", base, "us"))
        for case in CASES[1:]:
            figures.append(Figure(f"{op}_{case}", results[case][op], "us", "alone", base))
    report(f"torch ops on a second thread, {args.threads} threads", figures, args.json)


if __name__ == "__main__":
    main()
