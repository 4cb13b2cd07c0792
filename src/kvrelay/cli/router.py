"""``kvrelay router``: the HTTP ingress and the router; workers connect at ws://HOST:WORKER_PORT/workers."""

from __future__ import annotations

import argparse
import asyncio
import sys

from kvrelay.launch.config import ConfigError, Option, add_options, resolve

COMMAND = "router"
OPTIONS = (
    Option("host", str, "127.0.0.1", "address for HTTP and the worker WebSocket"),
    Option("port", int, 8000, "HTTP port of the OpenAI-compatible API (0: any free port)"),
    Option("worker_port", int, 8001, "port where workers connect, at path /workers (0: any free port)"),
    Option("model", str, [], "model source (directory or .gguf) whose tokenizer the router loads; repeat for "
                             "several; none: the default Gemma 3 270M", repeated=True),
    Option("db", str, None, "fact store URL (none: SQLite under the data directory)"),
    Option("secret_file", str, None, "file holding the shared secret workers must present "
                                     "(else $KVRELAY_SECRET)"),
    Option("policy", str, "kvrelay", "routing policy"),
    Option("chunk_tokens", int, 64, "tokens per routed KV chunk"),
    Option("offer_timeout_s", float, 2.0, "seconds an offer may go unanswered before it is re-routed"),
    Option("progress_timeout_s", float, 30.0, "seconds an accepted request may go silent before it is re-routed"),
    Option("worker_expiry_s", float, 3.0, "seconds without heartbeats after which a worker is fenced"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_options(parser, COMMAND, OPTIONS)


def run(args: argparse.Namespace) -> int:
    from kvrelay.models.loading.weight_layout import ModelLoadError
    from kvrelay.launch.router import RouterOptions, run_router
    from kvrelay.transport.auth import SecretError, load_secret

    try:
        values = resolve(args, COMMAND, OPTIONS)
        secret = load_secret(values["secret_file"])
    except (ConfigError, SecretError) as exc:
        print(f"kvrelay router: {exc}", file=sys.stderr)
        return 2
    options = RouterOptions(
        secret=secret, host=values["host"], port=values["port"], worker_port=values["worker_port"],
        model_sources=tuple(values["model"]) or (None,), db_url=values["db"], policy=values["policy"],
        chunk_tokens=values["chunk_tokens"], offer_timeout_s=values["offer_timeout_s"],
        progress_timeout_s=values["progress_timeout_s"], worker_expiry_s=values["worker_expiry_s"],
    )

    def ready(http_url: str, workers_url: str) -> None:
        print(f"kvrelay router ready http={http_url} workers={workers_url}", flush=True)

    try:
        asyncio.run(run_router(options, ready))
    except ModelLoadError as exc:
        print(f"kvrelay router: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kvrelay router: cannot listen on {options.host} (HTTP port {options.port}, worker port "
              f"{options.worker_port}): {exc.strerror or exc}; pick free ports with --port and --worker-port",
              file=sys.stderr)
        return 2
    return 0
