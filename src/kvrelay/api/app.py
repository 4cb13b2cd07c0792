"""The OpenAI-compatible HTTP API (FastAPI): models, completions, chat completions, health, metrics.

A response's ``id`` is ``cmpl-`` (``chatcmpl-``) and the router's request id, which ``kvrelay explain`` takes
as it is. Streaming responses are server-sent events in OpenAI's chunk format ending
with ``data: [DONE]``. A client that disconnects cancels its request through
the router to the worker. Every error, a wrong route or method included, is
OpenAI's error body (``api.responses.ErrorBody``) with the HTTP status of
``api.errors``; a malformed body is a 400 naming the field, a body larger than
``Ingress.body_limit()`` a 413 sent before it is read whole. The bodies are read
and prepared by the ingress (off the event loop), so the OpenAPI document
(``/openapi.json``, from ``api.openapi``) describes them itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

# anyio imports its asyncio backend when the first task group opens, which starlette does for the first
# streamed response: 0.33 s of the router's CPU on that request's path (bench/vllm_path.py --profile). Now:
import anyio._backends._asyncio  # noqa: F401
import msgspec
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from kvrelay.api import openapi
from kvrelay.api.body import read_body
from kvrelay.api.errors import APIError
from kvrelay.api.ingress import Final, Ingress, Prepared, TextDelta, new_request_id
from kvrelay.api.responses import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChunkChoice,
    Completion,
    CompletionChoice,
    Delta,
    FinishReason,
    Health,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    Usage,
)
from kvrelay.api.schema import ChatRequest, CompletionRequest

_GENERATION_ERRORS = (400, 404, 413, 429, 500, 503)


def _events(chunk: str) -> dict[str, Any]:
    """The ``text/event-stream`` content whose events carry ``chunk`` as JSON (or an error body), then ``[DONE]``;
    in OpenAPI 3.1 an event stream's ``schema`` describes one event."""
    data = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [openapi.ref(chunk), openapi.ref("ErrorBody")]},
    }
    return {
        "schema": {
            "type": "object",
            "required": ["data"],
            "if": {"properties": {"data": {"const": "[DONE]"}}},
            "else": {"properties": {"data": data}},
        }
    }


def create_app(ingress: Ingress) -> FastAPI:
    app = FastAPI(title="kvrelay", version="0.1.0")

    def document() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(openapi.COMPONENTS)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = document  # type: ignore[method-assign]

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> Response:
        return _json(exc.body(), exc.status, exc.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 405:
            allowed = exc.headers.get("Allow", "") if exc.headers else ""
            message = f"{request.method} is not allowed on {request.url.path}; use {allowed or 'another method'}"
            error = APIError(405, message, "invalid_request_error", None, "method_not_allowed")
        elif exc.status_code == 404:
            message = f"no such route: {request.method} {request.url.path}; /openapi.json lists the routes"
            error = APIError(404, message, "invalid_request_error", None, "not_found")
        else:
            error = APIError(exc.status_code, str(exc.detail), "invalid_request_error", None, None)
        return _json(error.body(), error.status, exc.headers)

    @app.exception_handler(Exception)
    async def server_error(_: Request, exc: Exception) -> Response:
        # Starlette re-raises the exception after this response, so the server logs its traceback.
        error = APIError(500, f"the server failed on this request ({type(exc).__name__})", "server_error")
        return _json(error.body(), 500)

    @app.get("/v1/models", responses=openapi.responses({"application/json": {"schema": openapi.ref("ModelList")}}, ()))
    async def models() -> Response:
        cards = [ModelCard(id=name, object="model", created=0, owned_by="kvrelay") for name in sorted(ingress.models)]
        return _json(ModelList(object="list", data=cards))

    @app.get(
        "/health",
        responses={
            200: {"description": "a live worker serves a model", "content": _health_content()},
            503: {"description": "no live worker serves any model", "content": _health_content()},
        },
    )
    async def health() -> Response:
        ready = [name for name in ingress.models if ingress.serving(name)]
        return _json(Health(status="ok" if ready else "unavailable", models=ready), 200 if ready else 503)

    @app.get(
        "/metrics",
        responses={200: {"description": "Prometheus text exposition", "content": {"text/plain": _TEXT}}},
        response_class=Response,
    )
    async def metrics() -> Response:
        return Response(generate_latest(ingress.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post(
        "/v1/completions",
        openapi_extra=openapi.request_body(CompletionRequest),
        responses=openapi.responses(
            {"application/json": {"schema": openapi.ref("Completion")}, "text/event-stream": _events("Completion")},
            _GENERATION_ERRORS,
        ),
        response_class=Response,
    )
    async def completions(request: Request) -> Response:
        body, prepared = await ingress.completion(await read_body(request, ingress.body_limit()))
        return await respond(request, prepared, body.streamed, body.include_usage, chat=False)

    @app.post(
        "/v1/chat/completions",
        openapi_extra=openapi.request_body(ChatRequest),
        responses=openapi.responses(
            {
                "application/json": {"schema": openapi.ref("ChatCompletion")},
                "text/event-stream": _events("ChatCompletionChunk"),
            },
            _GENERATION_ERRORS,
        ),
        response_class=Response,
    )
    async def chat(request: Request) -> Response:
        body, prepared = await ingress.chat(await read_body(request, ingress.body_limit()))
        return await respond(request, prepared, body.streamed, body.include_usage, chat=True)

    async def respond(request: Request, p: Prepared, stream: bool, include_usage: bool, chat: bool) -> Response:
        request_id = new_request_id()
        rid = ("chatcmpl-" if chat else "cmpl-") + request_id
        created = int(time.time())
        events = ingress.generate(p, request_id, request.headers.get("traceparent"))
        if stream:
            first = await _first(events)
            return StreamingResponse(
                _sse(rid, created, p, chat, include_usage, first, events), media_type="text/event-stream"
            )
        return await _whole(request, rid, created, p, chat, events)

    return app


_TEXT: dict[str, Any] = {"schema": {"type": "string"}}


def _health_content() -> dict[str, Any]:
    return {"application/json": {"schema": openapi.ref("Health")}}


def _json(body: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(body), status, headers, media_type="application/json")


async def _first(events: AsyncIterator[TextDelta | Final]) -> TextDelta | Final:
    """The first event, so an error before any token becomes an HTTP error, not a broken stream."""
    try:
        return await events.__anext__()
    except BaseException:
        await events.aclose()  # type: ignore[attr-defined]
        raise


def _usage(final: Final) -> Usage:
    return Usage(
        prompt_tokens=final.prompt_tokens,
        completion_tokens=final.completion_tokens,
        total_tokens=final.prompt_tokens + final.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=final.cached_tokens),
    )


def _chunk(
    rid: str, created: int, p: Prepared, chat: bool, text: str | None, finish: FinishReason | None, first: bool
) -> ChatCompletionChunk | Completion:
    if chat:
        delta = Delta(role="assistant" if first else None, content=text)
        choice = ChunkChoice(index=0, delta=delta, finish_reason=finish)
        return ChatCompletionChunk(
            id=rid, object="chat.completion.chunk", created=created, model=p.model.name, choices=[choice]
        )
    return Completion(
        id=rid,
        object="text_completion",
        created=created,
        model=p.model.name,
        choices=[CompletionChoice(index=0, text=text or "", finish_reason=finish)],
    )


async def _sse(
    rid: str,
    created: int,
    p: Prepared,
    chat: bool,
    include_usage: bool,
    first_event: TextDelta | Final,
    events: AsyncIterator[TextDelta | Final],
) -> AsyncIterator[bytes]:
    def line(obj: Any) -> bytes:
        return b"data: " + msgspec.json.encode(obj) + b"\n\n"

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
                    last = _chunk(rid, created, p, chat, None, None, False)
                    last.choices = []
                    last.usage = _usage(event)
                    yield line(last)
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
) -> Response:
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
        return _json({}, 499)
    text, final = work.result()
    if chat:
        message = AssistantMessage(role="assistant", content=text)
        return _json(
            ChatCompletion(
                id=rid,
                object="chat.completion",
                created=created,
                model=p.model.name,
                choices=[ChatChoice(index=0, message=message, finish_reason=final.finish_reason)],
                usage=_usage(final),
            )
        )
    return _json(
        Completion(
            id=rid,
            object="text_completion",
            created=created,
            model=p.model.name,
            choices=[CompletionChoice(index=0, text=text, finish_reason=final.finish_reason)],
            usage=_usage(final),
        )
    )
