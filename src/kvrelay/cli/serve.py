"""``kvrelay serve``: router, one worker and the OpenAI-compatible API in one process."""

from __future__ import annotations

import argparse
import asyncio

from kvrelay.cli.ready import say_ready
from kvrelay.launch import defaults
from kvrelay.models.dtypes import DTYPE_NAMES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=defaults.HOST, help=f"address to listen on (default {defaults.HOST})")
    parser.add_argument(
        "--port", type=int, default=defaults.HTTP_PORT, help=f"HTTP port, 0: any free (default {defaults.HTTP_PORT})"
    )
    parser.add_argument(
        "--model", default=None, help="model directory (config.json + safetensors) or GGUF file; default: Gemma 3 270M"
    )
    parser.add_argument(
        "--dtype", choices=DTYPE_NAMES, default=defaults.DTYPE, help=f"weights and KV dtype (default {defaults.DTYPE})"
    )
    parser.add_argument(
        "--kv-tokens",
        type=int,
        default=defaults.KV_TOKENS,
        help=f"KV cache capacity in tokens (default {defaults.KV_TOKENS})",
    )
    parser.add_argument(
        "--lanes",
        type=int,
        default=defaults.LANES,
        help=f"concurrent sequences on the device (default {defaults.LANES})",
    )
    parser.add_argument("--db", default=None, help="fact store URL (default: SQLite under the data directory)")
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        help="most bytes a request body may have (default: 64 bytes per token of the model's context + 64 KiB)",
    )
    parser.add_argument(
        "--drain-s",
        type=float,
        default=defaults.DRAIN_S,
        help="on SIGINT/SIGTERM, seconds running requests may take to finish; then each ends with an error "
        f"event that says so, and the server exits 0 (default {defaults.DRAIN_S:g})",
    )
    parser.add_argument(
        "--otlp-endpoint",
        default=None,
        help="export request traces over OTLP/HTTP to this collector (http://HOST:4318; default: no tracing)",
    )


def run(args: argparse.Namespace) -> int:
    from kvrelay.launch.serve import ServeOptions, serve
    from kvrelay.launch.worker_assembly import WorkerSettings

    worker = WorkerSettings(
        defaults.SERVE_WORKER_ID, model=args.model, dtype=args.dtype, kv_tokens=args.kv_tokens, lanes=args.lanes
    )
    options = ServeOptions(
        host=args.host,
        port=args.port,
        db_url=args.db,
        drain_s=args.drain_s,
        worker=worker,
        max_body_bytes=args.max_body_bytes,
        otlp_endpoint=args.otlp_endpoint,
    )

    def ready(http_url: str) -> None:
        say_ready(f"kvrelay serve ready http={http_url}")

    asyncio.run(serve(options, ready))
    return 0
