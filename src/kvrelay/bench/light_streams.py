"""The light client of ``bench.streams`` (``StreamClient.LIGHT``): ``aiohttp`` and ``msgspec``.

``light_session(base_url, model, timeout_s)`` yields a ``bench.streams.Send`` with the official client's
contract (a token-id or text prompt, greedy, usage included; ``timeout_s`` for the next bytes; a cancel after so many
text chunks; errors kept in the record, never raised), at a small part of its CPU a chunk. On a machine where
the client shares the cores with the server it measures, each core-second the client takes is taken from
the server's device team, which pays nearly two for it (docs/performance.md, "Served decode against the
engine alone"); a user's clients run elsewhere.

A chunk's time is when the bytes that completed it were read (chunks read together share one), so a
client that falls behind does not stretch the server's figures.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import aiohttp
import msgspec

from kvrelay.bench.streams import Prompt, Send, StreamRecord, prompt_field


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


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    prompt: Prompt,
    max_tokens: int,
    record: StreamRecord,
    cancel_at: int | None,
) -> None:
    body = msgspec.json.encode(
        {
            "model": model,
            "prompt": prompt_field(prompt),
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
                        chunk = _decode_chunk(line[6:])
                        if chunk.error is not None:
                            record.error = f"error chunk: {chunk.error}"
                            return
                        record.read(chunk, now)
                if cancel_at is not None and len(record.token_times) >= cancel_at:
                    record.cancelled = True
                    response.close()
                    return
    except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"


@asynccontextmanager
async def light_session(base_url: str, model: str, timeout_s: float) -> AsyncIterator[Send]:
    """A session of unlimited connections; ``send`` streams one completion (see the module contract)."""
    timeout = aiohttp.ClientTimeout(total=None, sock_read=timeout_s)
    url = base_url + "/v1/completions"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        yield partial(_one, session, url, model)
