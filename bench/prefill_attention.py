"""Cold prefill TTFT of one engine: kvrelay's C prefill attention against torch's block-wise and fused paths.

One ``Engine`` (default Gemma 3 270M, bfloat16, ``--threads`` torch threads as
``kvrelay serve`` gives its device thread) prefills a cold prompt of
``--tokens`` (4096) random tokens, in chunks of its token budget (512), and
samples one token; the figure is the time to that token. Per round the prefill
attentions run alternating on fresh prompts: ``native`` (what the engine runs,
``prefill_attention_auto``: kvrelay's C kernel for this CPU, on AMX tiles or with
AVX-512 BF16 dot products, where one loads), ``blockwise``
(``models.kernels.prefill_attention``, torch) and ``masked`` (``fused_prefill_attention``:
``scaled_dot_product_attention`` over the whole gathered window with an explicit
mask, or ``is_causal`` for a fresh chunk the window does not bind); the title names
the kind ``prefill_kernel`` picks for this CPU. With
``--bf16-scores`` a third path runs too, not taken: block-wise with the scores of a
bfloat16 ``q k^T`` rounded to bfloat16 (as in transformers' eager attention and
``decode_attention``), whose matmul runs through oneDNN's bfloat16 kernels. Medians
over ``--rounds`` rounds, and the spread (min..max) of the ratio per round;
``attention_s`` is the time inside the prefill attention calls of one prompt.

Run: ``.venv/bin/python bench/prefill_attention.py --json bench/results/prefill_attention.json``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from kvrelay.bench.report import Figure, report
from kvrelay.models.kernels import attention
from kvrelay.models.kernels.prefill_attention import (
    PrefillKernel,
    PrefillSpan,
    _mask_edges,
    fused_prefill_attention,
    native_kernel,
    prefill_attention,
    prefill_attention_auto,
    prefill_kernel,
)
from kvrelay.protocol.messages import Sampling
from kvrelay.worker.runtime.engine import Engine, EngineOptions


def bf16_scores_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, span: PrefillSpan, scale: float, block: int = 128
) -> torch.Tensor:
    """``prefill_attention`` with the scores' matmul in the inputs' dtype (rounded scores), then float32."""
    queries, heads, head_dim = q.shape
    kv_heads = k.shape[0]
    group = heads // kv_heads
    out = torch.empty_like(q)
    for h in range(kv_heads):
        for start in range(0, queries, block):
            stop = min(queries, start + block)
            first, last = span.first_query + start, span.first_query + stop - 1
            lo = max(span.first_key, 0 if span.window is None else first - span.window + 1)
            keys = slice(lo - span.first_key, last + 1 - span.first_key)
            rows = q[start:stop, h * group : (h + 1) * group].reshape(-1, head_dim)
            scores = torch.mm(rows, k[h, keys].t()).float().mul_(scale)
            _mask_edges(scores.view(stop - start, group, -1), first, last, lo, span.window)
            probs = torch.softmax(scores, dim=-1).to(v.dtype)
            out[start:stop, h * group : (h + 1) * group] = torch.mm(probs, v[h, keys]).view(-1, group, head_dim)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--model", default=None, help="model directory or GGUF (default: Gemma 3 270M)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bf16-scores", action="store_true", help="also time bfloat16-rounded scores")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = Engine.open(args.model, dtype="bfloat16", options=EngineOptions(kv_tokens=2 * args.tokens + 1024))
    kernels = {"native": prefill_attention_auto, "blockwise": prefill_attention, "masked": fused_prefill_attention}
    if args.bf16_scores:
        kernels["bf16_scores"] = bf16_scores_prefill
    ttft: dict[str, list[float]] = {name: [] for name in kernels}
    inside: dict[str, list[float]] = {name: [] for name in kernels}
    try:
        for rnd in range(args.rounds + 1):
            for i, (name, kernel) in enumerate(kernels.items()):
                spent = [0.0]
                attention.prefill_attention_auto = _timed(kernel, spent)
                salt = len(kernels) * rnd + i
                prompt = [2] + [1000 + salt * 11 + (t * 37) % 20000 for t in range(args.tokens - 1)]
                seconds = _ttft(engine, prompt, Sampling())
                if rnd > 0:  # round 0 warms both paths up
                    ttft[name].append(seconds)
                    inside[name].append(spent[0])
                print(f"round {rnd} {name}: {seconds:.3f} s, {spent[0]:.3f} s in prefill attention", flush=True)
    finally:
        attention.prefill_attention_auto = prefill_attention_auto
        engine.close()
    medians = {name: statistics.median(times) for name, times in ttft.items()}
    native = medians["native"]
    best = min(("blockwise", "masked"), key=medians.__getitem__)
    torch_path = medians[best]
    ratios = [t / n for t, n in zip(ttft[best], ttft["native"], strict=True)]
    figures = [
        Figure("cold_ttft_s", native, "s", f"torch {best} prefill attention", torch_path),
        Figure("speedup", torch_path / native, "x", None, None),
        Figure("speedup_min", min(ratios), "x", None, None),
        Figure("speedup_max", max(ratios), "x", None, None),
        Figure(
            "attention_s", statistics.median(inside["native"]), "s", f"torch {best}", statistics.median(inside[best])
        ),
        Figure("blockwise_cold_ttft_s", medians["blockwise"], "s", None, None),
        Figure("masked_cold_ttft_s", medians["masked"], "s", None, None),
    ]
    if args.bf16_scores:
        figures.append(Figure("bf16_scores_cold_ttft_s", medians["bf16_scores"], "s", f"torch {best}", torch_path))
    chosen = prefill_kernel(torch.bfloat16)
    title = f"{engine.artifacts.name}, {args.tokens}-token cold prefill, {args.threads} threads, bfloat16"
    title += f"; torch's kind for this CPU: {chosen.value}; native: {native_kernel_name(chosen)}"
    report(title, figures, args.json)
    return 0


def native_kernel_name(kind: PrefillKernel) -> str:
    """Which C kernel the engine tries first for bfloat16 with ``kind``, and whether it loads here."""
    kernel = native_kernel(kind)
    return f"{kernel.entry} ({'loads' if kernel.library() is not None else 'does not load: torch runs'})"


def _timed(kernel: Callable[..., torch.Tensor], spent: list[float]) -> Callable[..., torch.Tensor]:
    """``kernel``, adding the seconds each call takes to ``spent[0]``."""

    def timed(*args: object) -> torch.Tensor:
        start = time.perf_counter()
        out = kernel(*args)
        spent[0] += time.perf_counter() - start
        return out

    return timed


def _ttft(engine: Engine, prompt: list[int], sampling: Sampling) -> float:
    """Seconds from submitting ``prompt`` to its first token's event."""
    first: list[float] = []
    start = time.perf_counter()
    engine.generate(prompt, 1, sampling, on_event=lambda _: first.append(time.perf_counter()))
    return first[0] - start


if __name__ == "__main__":
    raise SystemExit(main())
