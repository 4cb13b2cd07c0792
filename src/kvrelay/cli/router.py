"""``kvrelay router``: the HTTP ingress and the router; workers connect at ws://HOST:WORKER_PORT/workers."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import TYPE_CHECKING

from kvrelay.cli.ready import say_ready
from kvrelay.core.router.queue import Limits
from kvrelay.core.router.state import RouterConfig
from kvrelay.launch import defaults
from kvrelay.launch.config import ConfigError, Option, add_options, parse_bool, resolve
from kvrelay.transport.auth import SECRET_ENV_VAR

if TYPE_CHECKING:
    from kvrelay.launch.vllm_worker import VllmSettings

COMMAND = "router"
ROUTER_DEFAULTS = RouterConfig()
"""The pure router's defaults: chunk size and timeouts have their one home there."""
OPTIONS = (
    Option("host", str, defaults.HOST, "address for HTTP and the worker WebSocket"),
    Option("port", int, defaults.HTTP_PORT, "HTTP port of the OpenAI-compatible API (0: any free port)"),
    Option("worker_port", int, defaults.WORKER_PORT, "port where workers connect, at path /workers (0: any free port)"),
    Option(
        "model",
        str,
        [],
        "model source (directory or .gguf) whose tokenizer the router loads; repeat for "
        "several; none: the default Gemma 3 270M",
        repeated=True,
    ),
    Option(
        "vllm_engine",
        str,
        [],
        "a vLLM OpenAI server this router drives from its own process, as worker vN (the N-th given): URL or "
        "URL,KV_EVENTS (e.g. http://127.0.0.1:8100,tcp://127.0.0.1:5557); repeat for several; remote workers may "
        "still connect",
        repeated=True,
    ),
    Option(
        "vllm_in_process",
        int,
        0,
        "vLLM engines of --model (exactly one) to run in this process, without vLLM's OpenAI server, as workers "
        "after the --vllm-engine ones; needs vLLM in this interpreter (.venv-vllm/bin/kvrelay router ...)",
    ),
    Option("vllm_dtype", str, defaults.DTYPE, "the dtype the vLLM engines run (it is in the KV fingerprint)"),
    Option(
        "vllm_lanes",
        int,
        defaults.VLLM_LANES,
        "concurrent requests each vLLM engine runs at most (its --max-num-seqs)",
    ),
    Option("vllm_kv_cache_bytes", int, None, "with --vllm-in-process: each engine's KV cache (none: vLLM's default)"),
    Option("vllm_max_model_len", int, None, "with --vllm-in-process: each engine's context (none: the model's)"),
    Option("status_host", str, defaults.STATUS_HOST, "address of the read-only status listener (GET /status)"),
    Option("status_port", int, 0, "port of the read-only status listener (0: any free port; named in the ready line)"),
    Option("db", str, None, "fact store URL (none: SQLite under the data directory)"),
    Option("secret_file", str, None, f"file holding the shared secret workers must present (else ${SECRET_ENV_VAR})"),
    Option("policy", str, defaults.POLICY, "routing policy"),
    Option(
        "otlp_endpoint",
        str,
        None,
        "export request traces over OTLP/HTTP to this collector (http://HOST:4318; none: no tracing)",
    ),
    Option("chunk_tokens", int, ROUTER_DEFAULTS.chunk_tokens, "tokens per routed KV chunk"),
    Option(
        "offer_timeout_s",
        float,
        ROUTER_DEFAULTS.offer_timeout_s,
        "seconds an offer may go unanswered before it is re-routed",
    ),
    Option(
        "progress_timeout_s",
        float,
        ROUTER_DEFAULTS.progress_timeout_s,
        "seconds an accepted request may go silent before it is re-routed",
    ),
    Option(
        "max_body_bytes",
        int,
        None,
        "most bytes a request body may have (none: 64 bytes per token of the largest served context + 64 KiB)",
    ),
    Option(
        "worker_expiry_s",
        float,
        ROUTER_DEFAULTS.worker_expiry_s,
        "seconds without heartbeats after which a worker is fenced",
    ),
    Option(
        "predict_on_route",
        parse_bool,
        ROUTER_DEFAULTS.predict_on_route,
        "credit the chosen worker with a routed request's chunks until they are resident (true or false)",
    ),
    Option(
        "drain_s",
        float,
        defaults.DRAIN_S,
        "on SIGINT/SIGTERM, seconds running requests may take to finish; then each ends with an error event "
        "that says so, and the router exits 0",
    ),
    Option(
        "queue_start_within_s",
        float,
        ROUTER_DEFAULTS.queue.start_within_s,
        "a request waits in the router queue while no worker would start it within this many seconds "
        "(inf: only while none has room)",
    ),
    Option(
        "queue_max_requests",
        int,
        ROUTER_DEFAULTS.queue.max_requests,
        "most requests the router queue holds per model; a new one beyond is a 429 with Retry-After",
    ),
    Option(
        "queue_max_wait_s",
        float,
        ROUTER_DEFAULTS.queue.max_wait_s,
        "a new request is a 429 with Retry-After when the predicted work waiting ahead of it, per worker, "
        "exceeds this many seconds (inf: no bound)",
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_options(parser, COMMAND, OPTIONS)


def run(args: argparse.Namespace) -> int:
    from kvrelay.engines.vllm.client import EngineError
    from kvrelay.engines.vllm.identity import EngineModelError
    from kvrelay.launch.router import RouterOptions, run_router
    from kvrelay.models.loading.weight_layout import ModelLoadError
    from kvrelay.transport.auth import SecretError, load_secret

    try:
        values = resolve(args, COMMAND, OPTIONS)
        secret = load_secret(values["secret_file"])
    except (ConfigError, SecretError) as exc:
        print(f"kvrelay router: {exc}", file=sys.stderr)
        return 2
    try:
        queue = Limits(values["queue_start_within_s"], values["queue_max_requests"], values["queue_max_wait_s"])
    except ValueError as exc:
        print(f"kvrelay router: {exc}", file=sys.stderr)
        return 2
    config = RouterConfig(
        offer_timeout_s=values["offer_timeout_s"],
        progress_timeout_s=values["progress_timeout_s"],
        worker_expiry_s=values["worker_expiry_s"],
        chunk_tokens=values["chunk_tokens"],
        predict_on_route=values["predict_on_route"],
        queue=queue,
    )
    try:
        engines = vllm_engines(values["vllm_engine"], values["vllm_dtype"], values["model"], values["vllm_lanes"])
        engines += in_process_engines(
            values["vllm_in_process"],
            len(engines),
            values["model"],
            values["vllm_dtype"],
            values["vllm_lanes"],
            values["vllm_kv_cache_bytes"],
            values["vllm_max_model_len"],
        )
    except ValueError as exc:
        print(f"kvrelay router: {exc}", file=sys.stderr)
        return 2
    options = RouterOptions(
        engines=engines,
        secret=secret,
        host=values["host"],
        port=values["port"],
        worker_port=values["worker_port"],
        model_sources=tuple(values["model"]) or (None,),
        db_url=values["db"],
        policy=values["policy"],
        config=config,
        max_body_bytes=values["max_body_bytes"],
        drain_s=values["drain_s"],
        otlp_endpoint=values["otlp_endpoint"],
        status_host=values["status_host"],
        status_port=values["status_port"],
    )

    def ready(http_url: str, workers_url: str, status_url: str) -> None:
        say_ready(f"kvrelay router ready http={http_url} workers={workers_url} status={status_url}")

    try:
        asyncio.run(run_router(options, ready))
    except (EngineError, EngineModelError) as exc:
        print(f"kvrelay router: {exc}", file=sys.stderr)
        return 2
    except ModelLoadError as exc:
        print(f"kvrelay router: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(
            f"kvrelay router: cannot listen on {options.host} (HTTP port {options.port}, worker port "
            f"{options.worker_port}): {exc.strerror or exc}; pick free ports with --port and --worker-port",
            file=sys.stderr,
        )
        return 2
    return 0


def vllm_engines(
    specs: list[str], dtype: str, models: list[str], lanes: int = defaults.VLLM_LANES
) -> tuple[VllmSettings, ...]:
    """``--vllm-engine`` values as worker settings ``v1``, ``v2``, ...; the model directory is the one ``--model``
    given (when exactly one is), else the one each engine reports. Raises ValueError naming a malformed value."""
    from kvrelay.launch.vllm_worker import VllmSettings

    out = []
    for i, spec in enumerate(specs, start=1):
        url, _, events = spec.partition(",")
        if not url.startswith(("http://", "https://")) or (events and not events.startswith("tcp://")):
            raise ValueError(
                f"--vllm-engine {spec!r} is not URL or URL,KV_EVENTS; e.g. http://127.0.0.1:8100,tcp://127.0.0.1:5557"
            )
        model = models[0] if len(models) == 1 else None
        out.append(VllmSettings(f"v{i}", url.rstrip("/"), events or None, model, dtype, max_lanes=lanes))
    return tuple(out)


IN_PROCESS_POLL_S = 0.1
"""Seconds between an in-process engine's figures reads: a read costs no HTTP request and no exposition, so
admission sees what the engine's last step reported within a tenth of a second."""


def in_process_engines(
    count: int,
    after: int,
    models: list[str],
    dtype: str,
    lanes: int,
    kv_cache_bytes: int | None,
    max_model_len: int | None,
) -> tuple[VllmSettings, ...]:
    """``--vllm-in-process`` as worker settings ``v{after+1}``, ...: engines of the one ``--model`` directory, each
    publishing its KV events on a free loopback port. Raises ValueError naming what is missing."""
    from dataclasses import replace
    from pathlib import Path

    from kvrelay.launch.ports import free_port
    from kvrelay.launch.vllm_server import VllmServerSpec
    from kvrelay.launch.vllm_worker import VllmSettings

    if count < 0:
        raise ValueError(f"--vllm-in-process must be 0 or more, got {count}")
    if count and (len(models) != 1 or not Path(models[0]).is_dir()):
        raise ValueError("--vllm-in-process needs exactly one --model, a model directory vLLM can load")
    out = []
    for i in range(after + 1, after + count + 1):
        spec = VllmServerSpec(
            model=str(Path(models[0]).resolve()),
            port=0,
            events_port=free_port(),
            python=sys.executable,
            served_name=Path(models[0]).name,
            dtype=dtype,
            max_model_len=max_model_len,
            kv_cache_bytes=kv_cache_bytes,
            max_num_seqs=lanes,
        )
        url = f"in-process://{spec.model}"
        settings = VllmSettings(f"v{i}", url, spec.events_url, spec.model, dtype, lanes, poll_s=IN_PROCESS_POLL_S)
        out.append(replace(settings, in_process=spec))
    return tuple(out)
