"""``kvrelay generate``: run one prompt through the paged runtime and print the continuation.

The continuation streams to stdout as tokens arrive (decoded incrementally);
the default model is Gemma 3 270M (``load_artifacts(None)``). Bad arguments or a
model that cannot be loaded print one clear line to stderr and exit with 2.
"""

from __future__ import annotations

import argparse
import queue
import sys

from kvrelay.models.dtypes import DTYPE_NAMES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", metavar="PROMPT", help="the text to continue")
    parser.add_argument("--model", default=None, help="model directory or GGUF file (default: Gemma 3 270M)")
    parser.add_argument("--dtype", default="float32", choices=DTYPE_NAMES, help="weights and KV dtype")
    parser.add_argument("--max-tokens", type=int, required=True, help="maximum number of new tokens")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)")
    parser.add_argument("--top-k", type=int, default=0, help="0 = no top-k cut (default)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")


def run(args: argparse.Namespace) -> int:
    import msgspec
    import torch

    from kvrelay.models.loading.loader import load_artifacts
    from kvrelay.models.loading.weight_layout import ModelLoadError
    from kvrelay.protocol.messages import Sampling
    from kvrelay.worker.runtime.engine import Engine, EngineOptions, parse_dtype
    from kvrelay.worker.runtime.jobs import Job, JobResult, RuntimeEvent, TokenEvent
    from kvrelay.worker.runtime.torch_threads import confine_threads

    if args.max_tokens < 1:
        return _fail(f"--max-tokens must be at least 1, got {args.max_tokens}")
    torch.set_num_threads(max(1, args.threads))
    confine_threads()  # before loading: the runtime's device thread alone runs torch ops in parallel
    try:
        sampling = msgspec.convert(
            {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed}, Sampling
        )
    except msgspec.ValidationError as exc:
        return _fail(f"bad sampling option: {exc}")
    dtype = parse_dtype(args.dtype)
    try:
        artifacts = load_artifacts(args.model, dtype=dtype)
    except (ModelLoadError, OSError, ValueError) as exc:
        return _fail(f"cannot load the model: {exc}")
    sampling = msgspec.structs.replace(sampling, stop_token_ids=tuple(artifacts.config.eos_token_ids))
    tokenizer = artifacts.tokenizer
    prompt_ids = list(tokenizer(args.prompt)["input_ids"])
    needed = len(prompt_ids) + args.max_tokens
    if needed > artifacts.config.max_position_embeddings:
        return _fail(
            f"prompt ({len(prompt_ids)} tokens) + --max-tokens ({args.max_tokens}) exceeds the model's context "
            f"of {artifacts.config.max_position_embeddings} tokens"
        )
    events: queue.Queue[RuntimeEvent] = queue.Queue()
    options = EngineOptions(kv_tokens=needed, num_lanes=1, token_budget=512, queue_capacity=1)
    with Engine.from_artifacts(artifacts, dtype, options) as engine:
        pages = engine.allocate_pages(needed)
        job = Job(tuple(prompt_ids), tuple(pages), max_new_tokens=args.max_tokens, sampling=sampling)
        engine.runtime.submit(job, events.put)
        generated: list[int] = []
        shown = ""
        event = events.get()
        while isinstance(event, TokenEvent):
            generated.append(event.token)
            # hold back a trailing partial UTF-8 character until the next token completes it
            text = _text(tokenizer.decode(generated, skip_special_tokens=True)).rstrip("\ufffd")
            if text.startswith(shown):
                sys.stdout.write(text[len(shown) :])
                sys.stdout.flush()
                shown = text
            event = events.get()
    final = _text(tokenizer.decode(generated, skip_special_tokens=True))
    sys.stdout.write((final[len(shown) :] if final.startswith(shown) else "") + "\n")
    assert isinstance(event, JobResult)
    if event.finish_reason == "error":
        return _fail(f"generation failed: {event.error}")
    return 0


def _fail(message: str) -> int:
    print(f"kvrelay generate: {message}", file=sys.stderr)
    return 2


def _text(decoded: str | list[str]) -> str:
    """One decoded sequence's text (``decode`` of one id list gives a str)."""
    assert isinstance(decoded, str)
    return decoded
