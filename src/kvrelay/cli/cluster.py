"""``kvrelay cluster``: a router and N worker processes on this machine (with ``--engine vllm``: N vLLM servers
the router drives from its own process; with ``--engine vllm-in-process``: N vLLM engines in the router's
process), restarted when they crash, stopped together on Ctrl-C or SIGTERM (the
router drains first)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvrelay.cli.ready import say_ready
from kvrelay.launch import defaults
from kvrelay.launch.config import ConfigError, Option, add_options, resolve
from kvrelay.launch.restarts import RestartPolicy
from kvrelay.models.dtypes import DTYPE_NAMES

if TYPE_CHECKING:
    from kvrelay.launch.vllm_server import VllmServerSpec

COMMAND = "cluster"
RESTARTS = RestartPolicy()
"""The supervisor's restart defaults (their one home is ``launch.restarts``)."""
OPTIONS = (
    Option("workers", int, 2, "number of workers (with a vLLM engine: of vLLM engines, driven by the router)"),
    Option("host", str, defaults.HOST, "address for HTTP and the worker WebSocket"),
    Option("port", int, defaults.HTTP_PORT, "HTTP port of the OpenAI-compatible API"),
    Option("worker_port", int, 0, "port where the workers connect (0: any free port)"),
    Option("model", str, None, "model directory or .gguf file every worker serves; none: Gemma 3 270M"),
    Option(
        "engine",
        str,
        "native",
        "the workers' runtime: kvrelay's own (native); vllm: one vLLM server per worker, which the router drives "
        "from its own process; vllm-in-process: one vLLM engine per worker in the router's process, no server "
        "(the router runs from vLLM's venv); both vLLM kinds need --model DIR",
        choices=("native", "vllm", "vllm-in-process"),
    ),
    Option("vllm_python", str, None, "with a vLLM engine: the Python of vLLM's venv (default: .venv-vllm)"),
    Option("dtype", str, defaults.DTYPE, "weights and KV dtype of the workers", choices=DTYPE_NAMES),
    Option("kv_tokens", int, defaults.KV_TOKENS, "KV cache capacity in tokens per worker"),
    Option("lanes", int, defaults.LANES, "concurrent sequences per worker"),
    Option("db", str, None, "fact store URL of the router (none: SQLite under the data directory)"),
    Option(
        "otlp_endpoint",
        str,
        None,
        "export request traces over OTLP/HTTP to this collector (http://HOST:4318; none: no tracing)",
    ),
    Option(
        "grace_s", float, defaults.GRACE_S, "on shutdown, seconds running requests may take before they are handed over"
    ),
    Option(
        "drain_s",
        float,
        defaults.DRAIN_S,
        "on SIGINT/SIGTERM, seconds the router lets running requests take (the workers stay up meanwhile); "
        "then each ends with an error event that says so",
    ),
    Option(
        "max_restarts",
        int,
        RESTARTS.max_restarts,
        "restarts of one child (router or worker) within --restart-window-s before it is left down",
    ),
    Option("restart_window_s", float, RESTARTS.window_s, "the window in which --max-restarts counts restarts"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_options(parser, COMMAND, OPTIONS)


def run(args: argparse.Namespace) -> int:
    from kvrelay.launch.cluster import ClusterOptions, run_cluster
    from kvrelay.launch.vllm_server import VllmNotInstalled

    try:
        values = resolve(args, COMMAND, OPTIONS)
        engines: tuple[VllmServerSpec, ...] = ()
        if values["engine"] in ("vllm", "vllm-in-process"):
            engines = _engines(values)
    except (ConfigError, VllmNotInstalled) as exc:
        print(f"kvrelay cluster: {exc}", file=sys.stderr)
        return 2
    shared = ["--config", args.config] if args.config else []
    model = ["--model", values["model"]] if values["model"] else []
    tracing = ["--otlp-endpoint", values["otlp_endpoint"]] if values["otlp_endpoint"] else []
    router_args = [*shared, *model, *tracing, *(["--db", values["db"]] if values["db"] else [])]
    worker_args = [
        *shared,
        *model,
        *tracing,
        "--dtype",
        values["dtype"],
        "--kv-tokens",
        str(values["kv_tokens"]),
        "--lanes",
        str(values["lanes"]),
    ]
    options = ClusterOptions(
        workers=values["workers"],
        host=values["host"],
        port=values["port"],
        worker_port=values["worker_port"],
        router_args=tuple(router_args),
        worker_args=tuple(worker_args),
        grace_s=values["grace_s"],
        engines=engines,
        in_process=values["engine"] == "vllm-in-process",
        drain_s=values["drain_s"],
        restarts=RestartPolicy(max_restarts=values["max_restarts"], window_s=values["restart_window_s"]),
    )

    def ready(http_url: str, workers: list[str]) -> None:
        say_ready(f"kvrelay cluster ready http={http_url} workers={','.join(workers)}")

    try:
        return run_cluster(options, ready)
    except ValueError as exc:
        print(f"kvrelay cluster: {exc}", file=sys.stderr)
        return 2


def _engines(values: dict[str, Any]) -> tuple[VllmServerSpec, ...]:
    """One vLLM server per worker on free loopback ports, its KV cache sized to ``kv_tokens``."""
    from kvrelay.engines.vllm.identity import kv_bytes_per_token
    from kvrelay.launch.vllm_server import loopback_specs, vllm_python

    model = values["model"]
    if not model or not Path(model).expanduser().is_dir():
        raise ConfigError("--engine vllm needs --model DIR, a model directory (config.json + weights) vLLM can load")
    model_dir = Path(model).expanduser().resolve()
    kv_bytes = values["kv_tokens"] * kv_bytes_per_token(model_dir, values["dtype"])
    python = vllm_python(values["vllm_python"])
    return loopback_specs(model_dir, values["workers"], values["dtype"], kv_bytes, values["lanes"], python)
