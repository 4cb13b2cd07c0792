"""``kvrelay serve``: router, one worker and the OpenAI-compatible API in one process."""

from __future__ import annotations

import argparse
import asyncio


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    parser.add_argument("--model", default=None,
                        help="model directory (config.json + safetensors) or GGUF file; default: Gemma 3 270M")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16",
                        help="weights and KV dtype (default bfloat16)")
    parser.add_argument("--kv-tokens", type=int, default=65536, help="KV cache capacity in tokens (default 65536)")
    parser.add_argument("--lanes", type=int, default=16, help="concurrent sequences on the device (default 16)")
    parser.add_argument("--db", default=None, help="fact store URL (default: SQLite under the data directory)")


def run(args: argparse.Namespace) -> int:
    from kvrelay.launch.worker_assembly import WorkerSpec
    from kvrelay.launch.serve import ServeOptions, serve

    worker = WorkerSpec("local-0", model=args.model, dtype=args.dtype, kv_tokens=args.kv_tokens, lanes=args.lanes)
    options = ServeOptions(host=args.host, port=args.port, db_url=args.db, worker=worker)
    asyncio.run(serve(options))
    return 0
