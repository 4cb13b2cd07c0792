"""Open-loop replay of trace prompts against one OpenAI-compatible endpoint, measured at the client.

Contract of ``replay``: request ``i`` is sent ``prompts[i].arrival_s`` seconds
after the start (whatever the state of earlier requests: open loop), as a
streamed ``/v1/completions`` call (greedy, fixed seed, usage included). Its
TTFT is the time from sending it to the first streamed chunk that carries
a choice, whose text may be empty (a token that completes no character yet),
as vLLM's own serving benchmark counts it (``benchmarks/backend_request_func.py``:
"text could be empty here"); its cached tokens are the usage's
``prompt_tokens_details.cached_tokens`` (0 when the server does not report it). A request that fails (HTTP error, an
error chunk, no final usage, a timeout) is measured with ``error`` set and no
TTFT; ``replay`` itself never raises for one request.
"""

from __future__ import annotations

import asyncio
import gc
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from kvrelay.bench.trace.faces import Face
from kvrelay.bench.trace.prompts import TracePrompt


@dataclass(frozen=True, slots=True)
class Measured:
    index: int
    sent_s: float
    """When it was sent, from the start of the replay."""
    ttft_s: float | None
    latency_s: float | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    error: str | None = None


async def _one(
    client: httpx.AsyncClient, url: str, model: str, p: TracePrompt, started: float, timeout_s: float
) -> Measured:
    body = {
        "model": model,
        "prompt": p.text,
        "max_tokens": p.max_tokens,
        "temperature": 0.0,
        "seed": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    ttft: float | None = None
    usage: dict | None = None
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", url + "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")[:200]
                    return Measured(
                        p.index,
                        sent - started,
                        None,
                        None,
                        len(p.token_ids),
                        0,
                        0,
                        f"HTTP {response.status_code}: {text}",
                    )
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return Measured(
                            p.index,
                            sent - started,
                            ttft,
                            None,
                            len(p.token_ids),
                            0,
                            0,
                            f"error chunk: {chunk['error']}",
                        )
                    if ttft is None and chunk.get("choices"):
                        ttft = time.perf_counter() - sent
                    if chunk.get("usage"):
                        usage = chunk["usage"]
    except (httpx.HTTPError, TimeoutError, json.JSONDecodeError) as exc:
        return Measured(p.index, sent - started, ttft, None, len(p.token_ids), 0, 0, f"{type(exc).__name__}: {exc}")
    latency = time.perf_counter() - sent
    if usage is None:
        return Measured(p.index, sent - started, ttft, latency, len(p.token_ids), 0, 0, "no usage in the stream")
    details = usage.get("prompt_tokens_details") or {}
    return Measured(
        p.index,
        sent - started,
        ttft,
        latency,
        int(usage.get("prompt_tokens", 0)),
        int(usage.get("completion_tokens", 0)),
        int(details.get("cached_tokens") or 0),
        None if ttft is not None else "no token streamed",
    )


async def replay(url: str, model: str, prompts: Sequence[TracePrompt], timeout_s: float = 300.0) -> list[Measured]:
    """Send every prompt at its arrival time (see the module contract); the measurements in prompt order.

    The harness's own collector is off for the replay (what it holds is frozen first): a full collection of a
    heap of its size takes ~0.1 s on the idle machine (``launch.heap``), which would count in the TTFT of
    whatever setup was being measured."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256, keepalive_expiry=2.0)
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
            started = time.perf_counter()
            tasks: list[asyncio.Task[Measured]] = []
            for p in sorted(prompts, key=lambda q: q.arrival_s):
                delay = started + p.arrival_s - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.ensure_future(_one(client, url, model, p, started, timeout_s)))
            results = await asyncio.gather(*tasks)
    finally:
        gc.enable()
        gc.unfreeze()
    return sorted(results, key=lambda m: m.index)


async def wait_ready(url: str, model: str, face: Face, limit_s: float = 240.0) -> None:
    """Until ``url`` answers a one-token completion; ``RuntimeError`` with the exit report of ``face`` (whose
    processes serve ``url``) if one of them exits, ``TimeoutError`` if ``limit_s`` passes."""
    deadline = time.monotonic() + limit_s
    async with httpx.AsyncClient(timeout=30) as client:
        while time.monotonic() < deadline:
            face.check_running(f"the server behind {url}")
            try:
                r = await client.post(
                    url + "/v1/completions",
                    json={"model": model, "prompt": " ready", "max_tokens": 1, "temperature": 0.0},
                )
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.25)
    raise TimeoutError(f"{url} did not answer a completion within {limit_s:.0f} s")


WARMUP = tuple(f" warm {w} up" for w in ("alpha", "beta", "gamma", "delta"))
"""Four short prompts that load every lane's code paths before a replay (two tokens each)."""


async def warm_up(url: str, model: str) -> None:
    """Send the ``WARMUP`` prompts at once and wait for their answers."""
    async with httpx.AsyncClient(timeout=120) as client:
        await asyncio.gather(
            *(
                client.post(
                    url + "/v1/completions",
                    json={"model": model, "prompt": text, "max_tokens": 2, "temperature": 0.0},
                )
                for text in WARMUP
            )
        )
