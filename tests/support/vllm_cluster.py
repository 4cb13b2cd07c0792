"""vLLM workers for tests: start one in front of a session engine, read an engine's /metrics, send around kvrelay."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
from openai.types import Completion

from kvrelay.launch.child import ChildProcess
from kvrelay.launch.vllm_server import VllmServer, worker_engine_flags
from tests.support.processes import Router, child_env, kvrelay, stream_completion, wait_until


def engine_counts(server: VllmServer) -> dict[str, float]:
    """From the engine's /metrics: requests finished (``done``), running, and tokens generated (``generated``)."""
    text = httpx.get(server.spec.url + "/metrics", timeout=10).text
    counts = {"done": 0.0, "running": 0.0, "generated": 0.0}
    for line in text.splitlines():
        value = float(line.rsplit(" ", 1)[1]) if line.startswith("vllm:") else 0.0
        if line.startswith("vllm:request_success_total{"):
            counts["done"] += value
        elif line.startswith("vllm:num_requests_running{"):
            counts["running"] += value
        elif line.startswith("vllm:generation_tokens_total{"):
            counts["generated"] += value
    return counts


def settle(router: Router, worker_id: str, heartbeats: int = 2) -> None:
    """Wait for ``heartbeats`` more heartbeats of ``worker_id``: residency it published before them has arrived
    (one WebSocket keeps their order)."""
    seq = router.live_workers()[worker_id]["seq"]
    wait_until(lambda: router.live_workers()[worker_id]["seq"] >= seq + heartbeats or None, 30, f"{worker_id}'s beats")


def direct_completion(server: VllmServer, prompt: list[int], max_tokens: int) -> None:
    """A completion sent to the vLLM server itself, past kvrelay: only its KV events tell kvrelay about it."""
    model = httpx.get(server.spec.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    assert httpx.post(server.spec.url + "/v1/completions", json=body, timeout=120).status_code == 200


def vllm_worker(home: Path, worker_id: str, router_url: str, engine: VllmServer, *flags: str) -> ChildProcess:
    args = ["--worker-id", worker_id, "--router", router_url, *worker_engine_flags(engine.spec), "--heartbeat-s", "0.2"]
    args += flags
    return kvrelay(worker_id, "worker", args, child_env(home))


def routed_completion(http_url: str, model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """A streamed greedy completion through the router: its token count, finish reason and usage."""
    chunks = list(stream_completion(http_url, model, prompt, max_tokens))
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices") and c["choices"][0]["finish_reason"]]
    return {"finish": finish[-1] if finish else None, "usage": chunks[-1]["usage"]}


def openai_stream(http_url: str, model: str, prompt: str | list[int], max_tokens: int) -> list[Completion]:
    """The chunks of a greedy streamed completion through the official ``openai`` client, the usage last."""
    client = openai.OpenAI(base_url=http_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    stream = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    return list(stream)
