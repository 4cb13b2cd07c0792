"""A loopback HTTP/1.1 server standing in for a vLLM engine's ``/v1/completions``: the test's handler reads each
request's JSON body and writes the answer, chunked SSE in pieces of its choosing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import msgspec


def data(obj: object) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def token(*ids: int, finish: str | None = None) -> bytes:
    return data({"choices": [{"index": 0, "text": "", "token_ids": list(ids), "finish_reason": finish}]})


USAGE = data({"choices": [], "usage": {"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": 2}}})
DONE = b"data: [DONE]\n\n"

Handler = Callable[[dict[str, object], asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def engine(handler: Handler) -> AsyncIterator[str]:
    """A loopback HTTP/1.1 server: reads one POST body per connection and lets ``handler`` answer."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
        )
        body = msgspec.json.decode(await reader.readexactly(length))
        await handler(body, writer)
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()


def chunked_head(status: str = "200 OK") -> bytes:
    return f"HTTP/1.1 {status}\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n".encode()


def chunk(payload: bytes) -> bytes:
    return f"{len(payload):x}\r\n".encode() + payload + b"\r\n"
