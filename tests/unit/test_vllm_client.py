"""The vLLM engine client over real HTTP: a loopback server that writes a completion's SSE body in chosen pieces."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from kvrelay.engines.vllm.client import EngineClient, EngineError, StreamEvent, StreamReader, request_body
from kvrelay.protocol.messages import FinishReason, Sampling
from tests.support.sse_engine import DONE, USAGE, Handler, chunk, chunked_head, engine, token

SAMPLING = Sampling(temperature=0.0, top_p=1.0, top_k=0, seed=1, stop_token_ids=())


async def collect(url: str, prompt: tuple[int, ...] = (5, 6, 7)) -> list[StreamEvent]:
    client = EngineClient(url)
    try:
        return [event async for event in client.stream("served", prompt, 4, SAMPLING, 9)]
    finally:
        await client.close()


def test_tokens_that_arrive_together_are_one_event_and_the_usage_ends_the_stream() -> None:
    seen: list[dict[str, object]] = []
    second = asyncio.Event()

    async def handler(body: dict[str, object], writer: asyncio.StreamWriter) -> None:
        seen.append(body)
        writer.write(chunked_head() + chunk(token(11)))
        await writer.drain()
        await second.wait()  # the client has taken the first token
        writer.write(chunk(token(12) + token(13) + token(14, finish="length")) + chunk(USAGE + DONE) + b"0\r\n\r\n")
        await writer.drain()

    async def scenario() -> list[StreamEvent]:
        async with engine(handler) as url:
            client = EngineClient(url)
            events: list[StreamEvent] = []
            async for event in client.stream("served", (5, 6, 7), 4, SAMPLING, 9):
                events.append(event)
                second.set()
            await client.close()
            return events

    events = asyncio.run(scenario())
    assert [e.tokens for e in events] == [(11,), (12, 13, 14), ()]
    assert events[-1].finish_reason is FinishReason.LENGTH and events[-1].cached_tokens == 2
    assert seen == [msgspec.json.decode(msgspec.json.encode(request_body("served", (5, 6, 7), 4, SAMPLING, 9)))]


def test_a_refusal_a_stream_without_usage_and_an_absent_engine_are_engine_errors_naming_the_url() -> None:
    async def refuse(body: dict[str, object], writer: asyncio.StreamWriter) -> None:
        text = b'{"error": "prompt too long"}'
        writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n%s" % (len(text), text))
        await writer.drain()

    async def cut(body: dict[str, object], writer: asyncio.StreamWriter) -> None:
        writer.write(chunked_head() + chunk(token(11)) + chunk(DONE) + b"0\r\n\r\n")
        await writer.drain()

    async def scenario(handler: Handler) -> str:
        async with engine(handler) as url:
            with pytest.raises(EngineError) as caught:
                await collect(url)
            assert url in str(caught.value)
            return str(caught.value)

    assert "refused the request (400)" in asyncio.run(scenario(refuse))
    assert "prompt too long" in asyncio.run(scenario(refuse))
    assert "ended without its usage" in asyncio.run(scenario(cut))

    async def absent() -> None:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        with pytest.raises(EngineError, match=f"127.0.0.1:{port}"):
            await collect(f"http://127.0.0.1:{port}")

    asyncio.run(absent())


def test_the_reader_joins_lines_split_across_pieces_and_ignores_what_follows_the_usage() -> None:
    body = token(1) + token(2, 3) + token(4, finish="stop") + USAGE + token(99) + DONE
    reader = StreamReader()
    pieces = [body[:10], body[10:40], body[40:]]
    got = [reader.feed(piece) for piece in pieces]
    assert got[0] == () and sum(got, ()) == (1, 2, 3, 4)
    assert reader.final == StreamEvent((), FinishReason.STOP, 2)
    crlf = StreamReader()
    assert crlf.feed(token(7).replace(b"\n", b"\r\n") + b"data: [DONE]\r\n\r\n") == (7,)
    with pytest.raises(msgspec.DecodeError):
        StreamReader().feed(b"data: {not json\n\n")
