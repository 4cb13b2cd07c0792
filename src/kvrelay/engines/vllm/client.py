"""The HTTP side of a vLLM OpenAI server, as a kvrelay worker uses it.

- ``served_model()``: ``GET /v1/models``: the engine's served name, its model
  directory (``root``) and context limit (``max_model_len``);
  ``version()``: ``GET /version``; ``figures()``: ``GET /metrics``, parsed.
- ``stream(prompt, max_tokens, sampling, seed)``: a streaming
  ``POST /v1/completions`` with a token-id prompt and ``return_token_ids``, so
  the engine never tokenizes and kvrelay reads token ids, not text. It yields
  ``StreamEvent``: the token ids of each chunk in order, then one final event
  with the finish reason and the prompt tokens the engine served from its
  prefix cache. Whatever the engine has sent by the time the stream is read
  is one event: tokens that queued while the event loop was busy travel on
  together, so a loaded router relays fewer, larger chunks instead of falling
  behind. Stopping is kvrelay's: ``ignore_eos`` is set and the
  sampling's ``stop_token_ids`` are passed (a stop token ends the stream and
  is part of it, as on a native worker). Closing the generator early closes
  the HTTP stream, and vLLM aborts a request whose client disconnected.
- Any failure to reach the engine or to read its answer raises
  ``EngineError`` naming the URL.

The HTTP client is ``aiohttp`` (its C parser): with ``httpx`` the engine's
stream took about 2 ms of the router's CPU per request and 0.06 ms per token
more (docs/performance.md, "The router's CPU per request").
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import msgspec

from kvrelay.engines.vllm.metrics import EngineFigures, MetricsError, parse_metrics
from kvrelay.protocol.messages import FinishReason, Sampling


class EngineError(RuntimeError):
    """The vLLM engine could not be reached, or answered something unusable."""


@dataclass(frozen=True, slots=True)
class ServedModel:
    name: str
    root: str
    context_limit: int


@dataclass(frozen=True, slots=True)
class StreamEvent:
    tokens: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None
    """Set on the final event only."""
    cached_tokens: int = 0
    """Prompt tokens the engine took from its prefix cache (final event)."""


_FINISH = {"length": FinishReason.LENGTH, "stop": FinishReason.STOP, "abort": FinishReason.CANCELLED}


def request_body(model: str, prompt: tuple[int, ...], max_tokens: int, sampling: Sampling, seed: int) -> dict[str, Any]:
    """The JSON body of a streaming token-id completion (see the module docstring)."""
    return {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,
        "seed": seed,
        "ignore_eos": True,
        "stop_token_ids": list(sampling.stop_token_ids),
    }


def parse_chunk(data: dict[str, Any]) -> StreamEvent | None:
    """One SSE chunk's event: its token ids, or the final usage; None for a chunk with neither."""
    usage = data.get("usage")
    choices = data.get("choices") or []
    if usage and not choices:
        details = usage.get("prompt_tokens_details") or {}
        return StreamEvent(finish_reason=None, cached_tokens=int(details.get("cached_tokens") or 0))
    tokens: list[int] = []
    finish: FinishReason | None = None
    for choice in choices:
        tokens.extend(choice.get("token_ids") or ())
        reason = choice.get("finish_reason")
        if reason is not None:
            finish = _FINISH.get(reason, FinishReason.ERROR)
    if not tokens and finish is None:
        return None
    return StreamEvent(tuple(tokens), finish)


class StreamReader:
    """The events of a completion's SSE body, fed in the pieces it arrives in (pure; ``EngineClient.stream``).

    ``feed(data)`` returns the tokens of every complete ``data:`` line so far, as one tuple (a line split
    across pieces waits for its end); ``final`` is set once the usage chunk after the finish has arrived,
    and whatever follows it is ignored. A line that is not JSON raises ``msgspec.DecodeError``.
    """

    def __init__(self) -> None:
        self.final: StreamEvent | None = None
        self._finish: FinishReason | None = None
        self._rest = b""

    def feed(self, data: bytes) -> tuple[int, ...]:
        *lines, self._rest = (self._rest + data).split(b"\n")
        tokens: list[int] = []
        for line in lines:
            if self.final is not None or not line.startswith(b"data: ") or line.rstrip() == b"data: [DONE]":
                continue
            event = parse_chunk(msgspec.json.decode(line[6:]))
            if event is None:
                continue
            if event.tokens or event.finish_reason is not None:
                self._finish = event.finish_reason or self._finish
                tokens.extend(event.tokens)
            else:
                self.final = StreamEvent((), self._finish or FinishReason.ERROR, event.cached_tokens)
        return tuple(tokens)


class VllmEngine(Protocol):
    """What a vLLM worker drives: this module's ``EngineClient`` (an OpenAI server over HTTP) or
    ``in_process.InProcessEngine`` (vLLM's engine in this process); ``url`` names it in errors."""

    url: str

    async def close(self) -> None: ...

    async def served_model(self) -> ServedModel: ...

    async def version(self) -> str: ...

    async def figures(self) -> EngineFigures: ...

    def stream(
        self, model: str, prompt: tuple[int, ...], max_tokens: int, sampling: Sampling, seed: int
    ) -> AsyncIterator[StreamEvent]: ...


class EngineClient:
    """One vLLM server at ``url`` (see the module docstring)."""

    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self._timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(total=None, connect=self._timeout_s),
                auto_decompress=False,
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _get(self, path: str) -> bytes:
        try:
            async with self._http().get(self.url + path, timeout=aiohttp.ClientTimeout(total=5.0)) as response:
                body = await response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineError(f"vLLM engine at {self.url} is unreachable ({exc!r})") from None
        if response.status != 200:
            raise EngineError(f"vLLM engine at {self.url}{path} answered {response.status}")
        return body

    async def served_model(self) -> ServedModel:
        data = msgspec.json.decode(await self._get("/v1/models")).get("data") or []
        if not data:
            raise EngineError(f"vLLM engine at {self.url} serves no model")
        first = data[0]
        return ServedModel(str(first["id"]), str(first.get("root") or first["id"]), int(first["max_model_len"]))

    async def version(self) -> str:
        return str(msgspec.json.decode(await self._get("/version")).get("version", "unknown"))

    async def figures(self) -> EngineFigures:
        try:
            return parse_metrics((await self._get("/metrics")).decode())
        except MetricsError as exc:
            raise EngineError(f"vLLM engine at {self.url}: {exc}") from None

    async def stream(
        self, model: str, prompt: tuple[int, ...], max_tokens: int, sampling: Sampling, seed: int
    ) -> AsyncIterator[StreamEvent]:
        body = msgspec.json.encode(request_body(model, prompt, max_tokens, sampling, seed))
        reader = StreamReader()
        try:
            async with self._http().post(
                self.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
            ) as response:
                if response.status != 200:
                    text = (await response.read()).decode(errors="replace")[:300]
                    raise EngineError(f"vLLM engine at {self.url} refused the request ({response.status}): {text}")
                async for data in response.content.iter_any():  # whatever has arrived (module docstring)
                    tokens = reader.feed(data)
                    if tokens:
                        yield StreamEvent(tokens)
        except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError) as exc:
            raise EngineError(f"the stream from the vLLM engine at {self.url} broke ({exc!r})") from None
        if reader.final is None:
            raise EngineError(f"the stream from the vLLM engine at {self.url} ended without its usage")
        yield reader.final
