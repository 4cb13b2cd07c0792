"""The OpenAI-compatible HTTP API (FastAPI): models, completions, chat completions, health, metrics.

Streaming responses are server-sent events in OpenAI's chunk format ending
with ``data: [DONE]``. A client that disconnects cancels its request through
the router to the worker. Errors use OpenAI's error body with the HTTP status
of ``api.errors``; a malformed body is a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import (
    JSONResponse,
    Response,
    StreamingResponse,
)
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvrelay.api.errors import APIError
from kvrelay.api.ingress import Final, Ingress, Prepared, TextDelta
from kvrelay.api.schema import ChatRequest, CompletionRequest


def create_app(ingress: Ingress) -> FastAPI:
    app = FastAPI(title="kvrelay", version="0.1.0")

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        field = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        message = f"invalid request: {field or 'body'}: {first.get('msg', 'malformed')}"
        return JSONResponse(APIError(400, message, param=field, code="invalid_value").body(), status_code=400)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": 0, "owned_by": "kvrelay"} for name in sorted(ingress.models)
            ],
        }

    @app.get("/health")
    async def health() -> Response:
        ready = [name for name in ingress.models if ingress.serving(name)]
        body = {"status": "ok" if ready else "unavailable", "models": ready}
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(ingress.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        prepared = ingress.prepare_completion(body)
        return await respond(request, prepared, body.stream, _include_usage(body), chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        prepared = ingress.prepare_chat(body)
        return await respond(request, prepared, body.stream, _include_usage(body), chat=True)

    async def respond(request: Request, p: Prepared, stream: bool, include_usage: bool, chat: bool) -> Response:
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        events = ingress.generate(p)
        if stream:
            first = await _first(events)
            return StreamingResponse(
                _sse(rid, created, p, chat, include_usage, first, events), media_type="text/event-stream"
            )
        return await _whole(request, rid, created, p, chat, events)

    return app


def _include_usage(body: CompletionRequest | ChatRequest) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


async def _first(events: AsyncIterator[TextDelta | Final]) -> TextDelta | Final:
    """The first event, so an error before any token becomes an HTTP error, not a broken stream."""
    try:
        return await events.__anext__()
    except BaseException:
        await events.aclose()  # type: ignore[attr-defined]
        raise


def _usage(final: Final) -> dict[str, Any]:
    return {
        "prompt_tokens": final.prompt_tokens,
        "completion_tokens": final.completion_tokens,
        "total_tokens": final.prompt_tokens + final.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": final.cached_tokens},
    }


def _chunk(
    rid: str, created: int, p: Prepared, chat: bool, text: str | None, finish: str | None, first: bool
) -> dict[str, Any]:
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        return {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": p.model.name,
            "choices": [choice],
        }
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": p.model.name,
        "choices": [{"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}],
    }


async def _sse(
    rid: str,
    created: int,
    p: Prepared,
    chat: bool,
    include_usage: bool,
    first_event: TextDelta | Final,
    events: AsyncIterator[TextDelta | Final],
) -> AsyncIterator[bytes]:
    def line(obj: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"

    first = True
    try:
        event: TextDelta | Final | None = first_event
        while event is not None:
            if isinstance(event, TextDelta):
                yield line(_chunk(rid, created, p, chat, event.text, None, first))
                first = False
            else:
                yield line(_chunk(rid, created, p, chat, None if chat else "", event.finish_reason, first))
                if include_usage:
                    yield line(
                        {
                            "id": rid,
                            "object": "chat.completion.chunk" if chat else "text_completion",
                            "created": created,
                            "model": p.model.name,
                            "choices": [],
                            "usage": _usage(event),
                        }
                    )
                break
            try:
                event = await events.__anext__()
            except StopAsyncIteration:
                event = None
    except APIError as exc:
        yield line(exc.body())
    finally:
        await events.aclose()  # type: ignore[attr-defined]
    yield b"data: [DONE]\n\n"


async def _whole(
    request: Request, rid: str, created: int, p: Prepared, chat: bool, events: AsyncIterator[TextDelta | Final]
) -> JSONResponse:
    async def collect() -> tuple[str, Final]:
        parts: list[str] = []
        async for event in events:
            if isinstance(event, TextDelta):
                parts.append(event.text)
            else:
                return "".join(parts), event
        raise APIError(500, "the request ended without an outcome", "server_error")

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(collect())
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not work.done():
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await work  # the cancellation closes ``events`` inside ``collect``, which cancels through the router
        await events.aclose()  # type: ignore[attr-defined]
        return JSONResponse({}, status_code=499)
    text, final = work.result()
    if chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": final.finish_reason,
            "logprobs": None,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": final.finish_reason, "logprobs": None}
        obj = "text_completion"
    return JSONResponse(
        {
            "id": rid,
            "object": obj,
            "created": created,
            "model": p.model.name,
            "choices": [choice],
            "usage": _usage(final),
        }
    )
