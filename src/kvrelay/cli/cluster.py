"""``kvrelay cluster``: a router and N worker processes on this machine, stopped together on Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import sys

from kvrelay.launch import defaults
from kvrelay.launch.config import ConfigError, Option, add_options, resolve
from kvrelay.models.dtypes import DTYPE_NAMES

COMMAND = "cluster"
OPTIONS = (
    Option("workers", int, 2, "number of worker processes"),
    Option("host", str, defaults.HOST, "address for HTTP and the worker WebSocket"),
    Option("port", int, defaults.HTTP_PORT, "HTTP port of the OpenAI-compatible API"),
    Option("worker_port", int, 0, "port where the workers connect (0: any free port)"),
    Option("model", str, None, "model directory or .gguf file every worker serves; none: Gemma 3 270M"),
    Option("dtype", str, defaults.DTYPE, "weights and KV dtype of the workers", choices=DTYPE_NAMES),
    Option("kv_tokens", int, defaults.KV_TOKENS, "KV cache capacity in tokens per worker"),
    Option("lanes", int, defaults.LANES, "concurrent sequences per worker"),
    Option("db", str, None, "fact store URL of the router (none: SQLite under the data directory)"),
    Option(
        "grace_s", float, defaults.GRACE_S, "on shutdown, seconds running requests may take before they are handed over"
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_options(parser, COMMAND, OPTIONS)


def run(args: argparse.Namespace) -> int:
    from kvrelay.launch.cluster import ClusterOptions, run_cluster

    try:
        values = resolve(args, COMMAND, OPTIONS)
    except ConfigError as exc:
        print(f"kvrelay cluster: {exc}", file=sys.stderr)
        return 2
    shared = ["--config", args.config] if args.config else []
    model = ["--model", values["model"]] if values["model"] else []
    router_args = [*shared, *model, *(["--db", values["db"]] if values["db"] else [])]
    worker_args = [
        *shared,
        *model,
        "--dtype",
        values["dtype"],
        "--kv-tokens",
        str(values["kv_tokens"]),
        "--lanes",
        str(values["lanes"]),
    ]
    options = ClusterOptions(
        values["workers"],
        values["host"],
        values["port"],
        values["worker_port"],
        tuple(router_args),
        tuple(worker_args),
        values["grace_s"],
    )

    def ready(http_url: str, workers: list[str]) -> None:
        print(f"kvrelay cluster ready http={http_url} workers={','.join(workers)}", flush=True)

    try:
        return run_cluster(options, ready)
    except ValueError as exc:
        print(f"kvrelay cluster: {exc}", file=sys.stderr)
        return 2
