"""Benchmark of the paged runtime against ``transformers`` on the same weights, dtype and prompts.

Figures (one run, one process; the baseline is measured in the same run, right after
or interleaved with ours, on the runtime's device thread so both use the same torch
thread pool (``kvrelay.worker.runtime.torch_threads``); prefill and TTFT are the best of ``--repeats`` interleaved
runs because the CPU is shared; ``*_median`` figures give the median of the same runs):

1. ``decode_tokens_per_s``: aggregate decode throughput with ``--sequences`` (32)
   sequences resident at once (prompts spread evenly over ``--min-prompt`` ..
   ``--max-prompt`` tokens, ``--new-tokens`` each, greedy, no early stop). Baseline:
   ``transformers`` ``generate`` at batch ``--hf-batch`` (8) over every 4th prompt.
   Both count the tokens that come out after every sequence has its first one,
   over the time from then to the last token (a token clock: the runtime's token
   events, a ``generate`` streamer), so neither includes a prefill or a
   first step. Both are measured ``--decode-repeats`` (2) times, interleaved (ours,
   theirs, ours, theirs): the figure is the best of each,
   ``decode_tokens_per_s_median`` the median of each.
   ``decode_batch1_tokens_per_s``: the same clock for one sequence alone (a
   ``--single-prompt`` (256) token prompt, ``--single-new-tokens`` (64)), against
   ``generate`` at batch 1: what ``kvrelay generate`` feels like (not a goal).
2. ``prefill_tokens_per_s``: a ``--prefill-tokens`` (1,024) prompt, prompt tokens
   over time to first token. Baseline: ``generate(max_new_tokens=1)``.
3. ``warm_ttft_share``: TTFT of a ``--ttft-tokens`` (2,048) prompt whose first
   ``--resident-tokens`` (1,792) are already in pages, over its cold TTFT.
4. ``decode_bandwidth_floor_tokens_per_s``: the decode rate if a step took only the time to read,
   once, what it must read (every projection weight, the LM head, and each sequence's keys
   and values: its sliding window in sliding layers, all of it in full ones; averaged over
   the decode) at the read rate measured here (``stream_read_gbs``: a 1 GiB float32 sum, more
   than the last-level cache, on the device thread, best of 5). ``decode_share_of_bandwidth_floor`` is ours over it.
5. ``peak_rss``: peak resident memory of the process after the kvrelay decode run
   (before the baseline model exists), and at the end. It includes the runtime's
   extra copies made for speed: oneDNN-packed bf16 weights (the projections and the
   LM head, the weights' size again) and the per-lane sliding-window rings.

Run: ``.venv/bin/python bench/runtime.py --json bench-runtime.json`` (options shrink it).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

import torch

from kvrelay.bench.engines.compute import read_rate
from kvrelay.models.loading.loader import load_artifacts
from kvrelay.protocol.messages import Sampling
from kvrelay.worker.runtime.engine import Engine, EngineOptions, parse_dtype
from kvrelay.worker.runtime.jobs import Job, TokenEvent
from kvrelay.worker.runtime.torch_threads import confine_threads

GREEDY_NO_STOP = Sampling()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory or GGUF (default: Gemma 3 270M)")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--min-prompt", type=int, default=128)
    parser.add_argument("--max-prompt", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--hf-batch", type=int, default=8)
    parser.add_argument("--single-prompt", type=int, default=256, help="prompt tokens of the batch-1 decode figure")
    parser.add_argument("--single-new-tokens", type=int, default=64, help="new tokens of the batch-1 decode figure")
    parser.add_argument("--prefill-tokens", type=int, default=1024)
    parser.add_argument("--ttft-tokens", type=int, default=2048)
    parser.add_argument("--resident-tokens", type=int, default=1792)
    parser.add_argument("--token-budget", type=int, default=512, help="tokens per runtime forward")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats of the prefill/TTFT figures")
    parser.add_argument("--decode-repeats", type=int, default=2, help="interleaved repeats of the decode figure")
    parser.add_argument("--skip-baseline", action="store_true", help="measure kvrelay only")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    confine_threads()  # the runtime's device thread owns the torch pool; the baseline runs there too
    dtype = parse_dtype(args.dtype)
    t0 = time.perf_counter()
    artifacts = load_artifacts(args.model, dtype=dtype)
    print(f"loaded {artifacts.name} in {time.perf_counter() - t0:.1f} s; dtype {args.dtype}, {args.threads} threads")
    vocab = artifacts.config.vocab_size
    prompts = make_prompts(args.sequences, args.min_prompt, args.max_prompt, vocab)
    prefill_prompt = make_prompts(1, args.prefill_tokens, args.prefill_tokens, vocab, salt=1)[0]
    ttft_prompt = make_prompts(1, args.ttft_tokens, args.ttft_tokens, vocab, salt=2)[0]
    single_prompt = make_prompts(1, args.single_prompt, args.single_prompt, vocab, salt=3)

    kv_tokens = sum(len(p) + args.new_tokens for p in prompts) + 2 * args.ttft_tokens + args.prefill_tokens + 1024
    options = EngineOptions(
        kv_tokens=kv_tokens, num_lanes=max(args.sequences, 2), token_budget=args.token_budget, queue_capacity=64
    )
    figures: list[dict[str, Any]] = []
    print(f"load average before: {os.getloadavg()[0]:.1f}")
    with Engine.from_artifacts(artifacts, dtype, options) as engine:
        warm_up(engine)
        ours_decode = [runtime_decode(engine, prompts, args.new_tokens)]
        rss_ours = peak_rss_mib()
        on_device = engine.runtime.run_on_device
        hf = None if args.skip_baseline else on_device(lambda: hf_model(artifacts, dtype))
        hf_prompts = prompts[:: max(1, len(prompts) // args.hf_batch)][: args.hf_batch]
        hf_decode: list[float] = []
        for repeat in range(args.decode_repeats):  # interleaved: ours (the first already ran), theirs
            if repeat:
                ours_decode.append(runtime_decode(engine, prompts, args.new_tokens))
            if hf is not None:
                hf_decode.append(on_device(lambda: hf_decode_rate(hf, hf_prompts, args.new_tokens)))
        ours_single = runtime_decode(engine, single_prompt, args.single_new_tokens)
        hf_single = None if hf is None else on_device(lambda: hf_decode_rate(hf, single_prompt, args.single_new_tokens))
        ours_prefill: list[float] = []
        hf_prefill: list[float] = []
        cold: list[float] = []
        warm: list[float] = []
        for _ in range(args.repeats):  # interleaved, best of each: the CPU is shared and noisy
            ours_prefill.append(runtime_ttft(engine, prefill_prompt, resident=0))
            if hf is not None:
                hf_prefill.append(on_device(lambda: hf_prefill_time(hf, prefill_prompt)))
            cold.append(runtime_ttft(engine, ttft_prompt, resident=0))
            warm.append(runtime_ttft(engine, ttft_prompt, resident=args.resident_tokens))
        rss_all = peak_rss_mib()
        read_gbs = on_device(stream_read_gbs)  # after the memory figures: it holds 1 GiB for a moment
    print(f"load average after: {os.getloadavg()[0]:.1f}")

    baseline_name = f"transformers generate batch {args.hf_batch}"
    figures.append(
        figure(
            "decode_tokens_per_s", max(ours_decode), "tokens/s", baseline_name, max(hf_decode) if hf_decode else None
        )
    )
    figures.append(
        figure(
            "decode_tokens_per_s_median",
            median(ours_decode),
            "tokens/s",
            baseline_name,
            median(hf_decode) if hf_decode else None,
        )
    )
    figures.append(
        figure("decode_batch1_tokens_per_s", ours_single, "tokens/s", "transformers generate batch 1", hf_single)
    )
    figures.append(figure("decode_share_of_700_compute_limit", max(ours_decode) / 700.0, "ratio", "compute limit", 1.0))
    step_bytes = decode_bytes_per_step(artifacts.config, prompts, args.new_tokens, dtype)
    floor = len(prompts) / (step_bytes / (read_gbs * 1e9))
    figures.append(figure("stream_read_gbs", read_gbs, "GB/s", "none", None))
    figures.append(figure("decode_bytes_per_step", step_bytes / 1e6, "MB", "none", None))
    figures.append(figure("decode_bandwidth_floor_tokens_per_s", floor, "tokens/s", "none", None))
    figures.append(figure("decode_share_of_bandwidth_floor", max(ours_decode) / floor, "ratio", "bandwidth floor", 1.0))
    figures.append(
        figure(
            "prefill_tokens_per_s",
            len(prefill_prompt) / min(ours_prefill),
            "tokens/s",
            "transformers generate batch 1",
            len(prefill_prompt) / min(hf_prefill) if hf_prefill else None,
        )
    )
    figures.append(
        figure(
            "prefill_tokens_per_s_median",
            len(prefill_prompt) / median(ours_prefill),
            "tokens/s",
            "transformers generate batch 1",
            len(prefill_prompt) / median(hf_prefill) if hf_prefill else None,
        )
    )
    figures.append(figure("cold_ttft_s", min(cold), "s", "none", None))
    figures.append(figure("warm_ttft_s", min(warm), "s", "cold_ttft_s", min(cold)))
    figures.append(figure("warm_ttft_share", min(warm) / min(cold), "ratio", "goal", 0.15))
    figures.append(figure("warm_ttft_share_median", median(warm) / median(cold), "ratio", "goal", 0.15))
    figures.append(figure("peak_rss_kvrelay", rss_ours, "MiB", "none", None))
    figures.append(figure("peak_rss_with_baseline", rss_all, "MiB", "peak_rss_kvrelay", rss_ours))
    print_table(figures)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


def make_prompts(n: int, lo: int, hi: int, vocab: int, salt: int = 0) -> list[list[int]]:
    """``n`` deterministic prompts with lengths spread evenly over ``lo .. hi`` (ordinary token ids)."""
    gen = torch.Generator().manual_seed(1234 + salt)
    lengths = [lo + (hi - lo) * i // max(1, n - 1) for i in range(n)]
    lo_id, hi_id = (1000, min(vocab, 200_000)) if vocab > 2000 else (4, vocab)  # skip special ids
    return [torch.randint(lo_id, hi_id, (length,), generator=gen).tolist() for length in lengths]


def warm_up(engine: Engine) -> None:
    engine.generate(make_prompts(1, 64, 64, engine.artifacts.config.vocab_size, salt=3)[0], 4, GREEDY_NO_STOP)


def runtime_decode(engine: Engine, prompts: list[list[int]], new_tokens: int) -> float:
    """Prefill every prompt but its last token, then decode ``new_tokens`` of all at once; the decode rate."""
    tables = [tuple(engine.allocate_pages(len(p) + new_tokens)) for p in prompts]
    t0 = time.perf_counter()
    handles = [engine.runtime.submit(Job(tuple(p[:-1]), t)) for p, t in zip(prompts, tables)]
    for h in handles:
        h.result()
    print(f"  kvrelay prefill of {sum(len(p) - 1 for p in prompts)} tokens: {time.perf_counter() - t0:.1f} s")
    clock = TokenClock()
    decode = [
        engine.runtime.submit(
            Job((p[-1],), t, start_pos=len(p) - 1, max_new_tokens=new_tokens, sampling=GREEDY_NO_STOP),
            on_event=clock.on_event,
        )
        for p, t in zip(prompts, tables)
    ]
    generated = sum(len(h.result().tokens) for h in decode)
    for t in tables:
        engine.free_pages(list(t))
    assert generated == len(prompts) * new_tokens
    tokens, elapsed = clock.after_first_tokens()
    rate = tokens / elapsed
    print(f"  kvrelay decode: {tokens} tokens from {len(prompts)} sequences in {elapsed:.1f} s = {rate:.1f} tok/s")
    return rate


class TokenClock:
    """When each runtime token came out, per job (``on_event`` runs on the device thread)."""

    def __init__(self) -> None:
        self.times: dict[int, list[float]] = {}

    def on_event(self, event: object) -> None:
        if isinstance(event, TokenEvent):
            self.times.setdefault(event.job_id, []).append(time.perf_counter())

    def after_first_tokens(self) -> tuple[int, float]:
        """Tokens that came out after every job had its first one, and the seconds from then to the last."""
        start = max(times[0] for times in self.times.values())
        later = [t for times in self.times.values() for t in times if t > start]
        return len(later), max(later) - start


def runtime_ttft(engine: Engine, prompt: list[int], resident: int) -> float:
    """Seconds to the first token of ``prompt`` when its first ``resident`` tokens are already in pages."""
    table = tuple(engine.allocate_pages(len(prompt) + 1))
    try:
        if resident:
            engine.runtime.submit(Job(tuple(prompt[:resident]), table)).result()
        result = engine.runtime.submit(
            Job(tuple(prompt[resident:]), table, start_pos=resident, max_new_tokens=1, sampling=GREEDY_NO_STOP)
        ).result()
    finally:
        engine.free_pages(list(table))
    assert result.first_token_s is not None
    print(f"  kvrelay TTFT of {len(prompt)} tokens with {resident} resident: {result.first_token_s:.3f} s")
    return result.first_token_s


def stream_read_gbs() -> float:
    """The best rate, in GB/s, at which this thread's torch threads sum 1 GiB of float32 (a memory read bound)."""
    return read_rate(torch.get_num_threads()) / 1e9


def decode_bytes_per_step(config: Any, prompts: list[list[int]], new_tokens: int, dtype: torch.dtype) -> float:
    """Bytes one decode step of all ``prompts`` must read, averaged over ``new_tokens`` steps.

    Every projection weight and the LM head once, and each sequence's keys and values:
    the last ``sliding_window`` positions in sliding layers, all positions in full ones.
    """
    width = torch.tensor([], dtype=dtype).element_size()
    hidden, inner, d = config.hidden_size, config.intermediate_size, config.head_dim
    per_layer = (
        hidden * (config.num_heads + 2 * config.num_kv_heads) * d + config.num_heads * d * hidden + 3 * hidden * inner
    )
    weights = (config.num_layers * per_layer + config.vocab_size * hidden) * width
    kv_per_position = 2 * config.num_kv_heads * d * width
    sliding = sum(kind == "sliding_attention" for kind in config.layer_types)
    full = config.num_layers - sliding
    window = config.sliding_window or 0
    positions = 0
    for step in range(new_tokens):
        for p in prompts:
            length = len(p) + step
            positions += full * length + sliding * min(length, window)
    return weights + kv_per_position * positions / new_tokens


def hf_model(artifacts: Any, dtype: torch.dtype) -> Any:
    """The ``transformers`` model of the same config and weights (no hub, no second GGUF read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    c = artifacts.config
    config = AutoConfig.from_pretrained(artifacts.model_dir)  # a local directory: the config.json of these weights
    config = getattr(config, "text_config", None) or config
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = model.load_state_dict(dict(artifacts.weights), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and c.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"baseline weights do not fit: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.tie_weights()
    return model.to(dtype).eval()


def hf_decode_rate(model: Any, prompts: list[list[int]], new_tokens: int) -> float:
    """Decode tokens/s of ``generate`` on one left-padded batch of ``prompts``, after the first token."""
    from transformers.generation.streamers import BaseStreamer

    class StepClock(BaseStreamer):  # type: ignore[misc]
        """Notes when ``generate`` hands out each step's tokens (its first call carries the prompt)."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value: Any) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    longest = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), longest), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p) :] = torch.tensor(p)
        mask[i, longest - len(p) :] = 1
    with torch.inference_mode():  # warm-up: first-call allocations and kernel selection
        model.generate(
            input_ids=ids[:, -16:], attention_mask=mask[:, -16:], max_new_tokens=2, do_sample=False, pad_token_id=0
        )
        clock = StepClock()
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            streamer=clock,
        )
    assert out.shape[1] == longest + new_tokens and len(clock.times) == new_tokens + 1
    first, last = clock.times[1], clock.times[-1]
    rate = len(prompts) * (new_tokens - 1) / (last - first)
    print(
        f"  transformers batch {len(prompts)}: first token at {first - clock.times[0]:.1f} s, "
        f"{new_tokens - 1} more in {last - first:.1f} s -> {rate:.1f} tok/s"
    )
    return rate


def hf_prefill_time(model: Any, prompt: list[int]) -> float:
    """Seconds of ``generate(max_new_tokens=1)`` on ``prompt``."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)
        elapsed = time.perf_counter() - t0
    print(f"  transformers prefill of {len(prompt)} tokens: {elapsed:.2f} s")
    return elapsed


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def figure(name: str, value: float, unit: str, baseline: str, baseline_value: float | None) -> dict[str, Any]:
    return {
        "name": name,
        "value": round(value, 4),
        "unit": unit,
        "baseline": baseline,
        "baseline_value": None if baseline_value is None else round(baseline_value, 4),
    }


def print_table(figures: list[dict[str, Any]]) -> None:
    print(f"{'figure':36} {'value':>12} {'unit':10} {'baseline':>12}  (baseline name)  ratio")
    for f in figures:
        base = f["baseline_value"]
        ratio = "" if not base else f"{f['value'] / base:.2f}x"
        base_s = "" if base is None else f"{base:12.3f}"
        print(f"{f['name']:36} {f['value']:12.3f} {f['unit']:10} {base_s:>12}  ({f['baseline']})  {ratio}")


if __name__ == "__main__":
    sys.exit(main())
