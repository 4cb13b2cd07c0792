"""``kvrelay worker``: run one worker that serves a model for one or several routers."""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys

from kvrelay.cli.ready import say_ready
from kvrelay.launch import defaults
from kvrelay.launch.config import ConfigError, Option, add_options, parse_bool, resolve
from kvrelay.models.dtypes import DTYPE_NAMES
from kvrelay.protocol.chunk_keys import DEFAULT_CHUNK_TOKENS, DEFAULT_PAGE_TOKENS
from kvrelay.transport.auth import SECRET_ENV_VAR

COMMAND = "worker"
ENGINES = ("native", "vllm")
ROUTER = Option(
    "router", str, [], "router WebSocket URL, e.g. ws://127.0.0.1:8001/workers; repeat for several", repeated=True
)
OPTIONS = (
    ROUTER,
    Option("worker_id", str, socket.gethostname(), "stable id of this worker (give each worker on a host its own)"),
    Option("engine", str, "native", "the runtime: kvrelay's own (native) or a vLLM server", choices=ENGINES),
    Option("engine_url", str, None, "with --engine vllm: the vLLM OpenAI server, e.g. http://127.0.0.1:8100"),
    Option("kv_events", str, None, "with --engine vllm: its KV event publisher, e.g. tcp://127.0.0.1:5557"),
    Option(
        "model",
        str,
        None,
        "model directory (config.json + safetensors) or .gguf file; none: Gemma 3 270M "
        "(with --engine vllm: the directory the engine serves; none: the one it reports)",
    ),
    Option("dtype", str, defaults.DTYPE, "weights and KV dtype", choices=DTYPE_NAMES),
    Option("kv_tokens", int, defaults.KV_TOKENS, "KV cache capacity in tokens"),
    Option("page_tokens", int, DEFAULT_PAGE_TOKENS, "tokens per KV page"),
    Option("chunk_tokens", int, DEFAULT_CHUNK_TOKENS, "tokens per routed KV chunk"),
    Option("lanes", int, defaults.LANES, "concurrent sequences on the device"),
    Option("token_budget", int, defaults.TOKEN_BUDGET, "tokens per device iteration (chunked prefill budget)"),
    Option(
        "prefill_only_budget",
        int,
        defaults.PREFILL_ONLY_BUDGET,
        "tokens of a device iteration with no decoding lane (0: the token budget)",
    ),
    Option(
        "share_prefill",
        parse_bool,
        True,
        "re-match a prompt's prefix before its prefill and wait for a request already filling it (true or false)",
    ),
    Option(
        "exact_continuations",
        parse_bool,
        True,
        "continue a stream another worker dropped bit-exactly, replaying its delivered tokens as decode steps "
        "(false: recompute them in one prefill, sooner to the first token but the text may differ)",
    ),
    Option(
        "chunk_dir",
        str,
        None,
        "local chunk directory, the ssd tier (default: chunks/<worker id> under the data directory)",
    ),
    Option("ram_bytes", int, defaults.RAM_BYTES, "bytes of host RAM for the ram chunk tier"),
    Option("ssd_bytes", int, defaults.SSD_BYTES, "bytes of the local chunk directory"),
    Option("object_dir", str, None, "a directory shared by all workers, used as the object tier"),
    Option("s3_endpoint", str, None, "S3 endpoint URL of the object tier (instead of --object-dir)"),
    Option("s3_bucket", str, None, "S3 bucket of the object tier"),
    Option("s3_prefix", str, defaults.S3_PREFIX, "key prefix of chunks in the S3 bucket"),
    Option("peer_host", str, defaults.PEER_HOST, "address where peers fetch this worker's ram and ssd chunks"),
    Option("status_host", str, defaults.STATUS_HOST, "address of the read-only status listener (GET /status)"),
    Option("status_port", int, 0, "port of the read-only status listener (0: any free port; named in the ready line)"),
    Option("heartbeat_s", float, defaults.HEARTBEAT_S, "seconds between heartbeats"),
    Option(
        "grace_s",
        float,
        defaults.GRACE_S,
        "on SIGTERM, seconds running requests may take to finish before they are handed over to other workers",
    ),
    Option("secret_file", str, None, f"file holding the shared secret (else ${SECRET_ENV_VAR})"),
    Option(
        "otlp_endpoint",
        str,
        None,
        "export request traces over OTLP/HTTP to this collector (http://HOST:4318; none: no tracing)",
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_options(parser, COMMAND, OPTIONS)


def run(args: argparse.Namespace) -> int:
    from kvrelay.transport.auth import SecretError, load_secret

    try:
        values = resolve(args, COMMAND, OPTIONS)
        secret = load_secret(values["secret_file"])
        if not values["router"]:
            raise ConfigError(f"no router URL: pass {ROUTER.flag} ws://HOST:PORT/workers (or set ${ROUTER.env})")
        for url in values["router"]:
            _check_url(url)
    except (ConfigError, SecretError) as exc:
        print(f"kvrelay worker: {exc}", file=sys.stderr)
        return 2
    from kvrelay.engines.vllm.client import EngineError
    from kvrelay.engines.vllm.identity import EngineModelError
    from kvrelay.launch.vllm_worker import VllmSettings
    from kvrelay.launch.worker import WorkerOptions, run_worker
    from kvrelay.launch.worker_assembly import StoreSpec, WorkerSettings
    from kvrelay.models.loading.weight_layout import ModelLoadError

    settings: WorkerSettings | VllmSettings
    if values["engine"] == "vllm":
        if not values["engine_url"]:
            print("kvrelay worker: --engine vllm needs --engine-url http://HOST:PORT of a vLLM server", file=sys.stderr)
            return 2
        settings = VllmSettings(
            values["worker_id"],
            values["engine_url"],
            values["kv_events"],
            values["model"],
            values["dtype"],
            max_lanes=values["lanes"],
        )
    else:
        settings = WorkerSettings(
            values["worker_id"],
            values["model"],
            values["dtype"],
            values["kv_tokens"],
            values["page_tokens"],
            values["chunk_tokens"],
            values["lanes"],
            values["token_budget"],
            StoreSpec(
                values["chunk_dir"] or defaults.chunk_dir(values["worker_id"]),
                values["ram_bytes"],
                values["ssd_bytes"],
                values["object_dir"],
                s3_endpoint=values["s3_endpoint"],
                s3_bucket=values["s3_bucket"],
                s3_prefix=values["s3_prefix"],
                peer_host=values["peer_host"],
            ),
            share_prefill=values["share_prefill"],
            exact_continuations=values["exact_continuations"],
            prefill_only_budget=values["prefill_only_budget"],
        )
    options = WorkerOptions(
        settings,
        tuple(values["router"]),
        secret,
        values["heartbeat_s"],
        values["grace_s"],
        otlp_endpoint=values["otlp_endpoint"],
        status_host=values["status_host"],
        status_port=values["status_port"],
    )

    def ready(worker_id: str, epoch: int, model: str, status_url: str) -> None:
        say_ready(f"kvrelay worker ready id={worker_id} epoch={epoch} model={model} status={status_url}")

    try:
        asyncio.run(run_worker(options, ready))
    except (ModelLoadError, EngineError, EngineModelError) as exc:
        print(f"kvrelay worker: {exc}", file=sys.stderr)
        return 2
    return 0


def _check_url(url: str) -> None:
    from websockets.exceptions import InvalidURI
    from websockets.uri import parse_uri

    try:
        parse_uri(url)
    except InvalidURI as exc:
        raise ConfigError(f"router URL {url!r} is not usable ({exc}); expected ws://HOST:PORT/workers") from None
