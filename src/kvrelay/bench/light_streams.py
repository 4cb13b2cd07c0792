"""Streaming completions read by a light SSE client (``aiohttp`` and ``msgspec``), timed at the client.

The contract of ``bench.streams.run_streams`` (one ``StreamRecord`` per prompt, in prompt order; token-id
prompts, greedy, usage included; ``cancel_after``; ``timeout_s`` for the next bytes; errors kept in the
record, never raised), at a small part of the official ``openai`` client's CPU a chunk. On a machine where
the client shares the cores with the server it measures, each core-second the client takes is taken from
the server's device team, which pays nearly two for it (docs/performance.md, "Served decode against the
engine alone"); a user's clients run elsewhere.

A chunk's time is when the bytes that completed it were read (chunks read together share one), so a
client that falls behind does not stretch the server's figures.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp
import msgspec

from kvrelay.bench.streams import StreamRecord, new_records


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    completion_tokens: int = 0
    prompt_tokens_details: _Details | None = None


class _Choice(msgspec.Struct):
    text: str | None = None
    finish_reason: str | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = msgspec.field(default_factory=list)
    usage: _Usage | None = None
    error: Any = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


def _read_chunk(record: StreamRecord, chunk: _Chunk, now: float) -> None:
    """Fold one streamed chunk into ``record`` (text chunks timed at ``now``)."""
    if chunk.error is not None:
        record.error = f"error chunk: {chunk.error}"
    if chunk.usage is not None:
        record.completion_tokens = chunk.usage.completion_tokens
        details = chunk.usage.prompt_tokens_details
        record.cached_tokens = details.cached_tokens if details is not None else None
    for choice in chunk.choices:
        if choice.text:
            record.token_times.append(now)
            record.text += choice.text
        if choice.finish_reason:
            record.finish_reason = choice.finish_reason


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    prompt: Sequence[int],
    max_tokens: int,
    record: StreamRecord,
    cancel_at: int | None,
) -> None:
    body = msgspec.json.encode(
        {
            "model": model,
            "prompt": list(prompt),
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    record.sent = time.monotonic()
    try:
        async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as response:
            if response.status != 200:
                record.error = f"HTTP {response.status}: {(await response.read())[:300].decode(errors='replace')}"
                return
            rest = b""
            async for data in response.content.iter_any():
                now = time.monotonic()
                *lines, rest = (rest + data).split(b"\n")
                for line in lines:
                    if line.startswith(b"data: ") and line != b"data: [DONE]":
                        _read_chunk(record, _decode_chunk(line[6:]), now)
                if record.error is not None:
                    return
                if cancel_at is not None and len(record.token_times) >= cancel_at:
                    record.cancelled = True
                    response.close()
                    return
    except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"


async def _run(
    base_url: str,
    model: str,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    concurrency: int,
    cancel_after: dict[int, int],
    on_done: Callable[[StreamRecord], None],
    records: list[StreamRecord],
    timeout_s: float,
) -> list[StreamRecord]:
    gate = asyncio.Semaphore(max(1, concurrency))
    timeout = aiohttp.ClientTimeout(total=None, sock_read=timeout_s)
    url = base_url + "/v1/completions"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:

        async def guarded(i: int) -> None:
            async with gate:
                await _one(session, url, model, prompts[i], max_tokens, records[i], cancel_after.get(i))
            on_done(records[i])

        await asyncio.gather(*(guarded(i) for i in range(len(prompts))))
    return records


def run_light_streams(
    base_url: str,
    model: str,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    concurrency: int,
    cancel_after: dict[int, int] | None = None,
    on_done: Callable[[StreamRecord], None] = lambda r: None,
    records: list[StreamRecord] | None = None,
    timeout_s: float = 300.0,
) -> list[StreamRecord]:
    """``bench.streams.run_streams`` with the light client (see the module contract)."""
    records = new_records(prompts) if records is None else records
    return asyncio.run(
        _run(base_url, model, prompts, max_tokens, concurrency, cancel_after or {}, on_done, records, timeout_s)
    )
