"""The HTTP side of a vLLM OpenAI server, as a kvrelay worker uses it.

- ``served_model()``: ``GET /v1/models``: the engine's served name, its model
  directory (``root``) and context limit (``max_model_len``);
  ``version()``: ``GET /version``; ``figures()``: ``GET /metrics``, parsed.
- ``stream(prompt, max_tokens, sampling, seed)``: a streaming
  ``POST /v1/completions`` with a token-id prompt and ``return_token_ids``, so
  the engine never tokenizes and kvrelay reads token ids, not text. It yields
  ``StreamEvent``: the token ids of each chunk in order, then one final event
  with the finish reason and the prompt tokens the engine served from its
  prefix cache. Stopping is kvrelay's: ``ignore_eos`` is set and the
  sampling's ``stop_token_ids`` are passed (a stop token ends the stream and
  is part of it, as on a native worker). Closing the generator early closes
  the HTTP stream, and vLLM aborts a request whose client disconnected.
- Any failure to reach the engine or to read its answer raises
  ``EngineError`` naming the URL.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

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


class EngineClient:
    """One vLLM server at ``url`` (see the module docstring)."""

    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(timeout_s, read=None))

    async def close(self) -> None:
        await self._http.aclose()

    async def _get(self, path: str) -> httpx.Response:
        try:
            response = await self._http.get(path, timeout=5.0)
        except httpx.HTTPError as exc:
            raise EngineError(f"vLLM engine at {self.url} is unreachable ({exc!r})") from None
        if response.status_code != 200:
            raise EngineError(f"vLLM engine at {self.url}{path} answered {response.status_code}")
        return response

    async def served_model(self) -> ServedModel:
        data = (await self._get("/v1/models")).json().get("data") or []
        if not data:
            raise EngineError(f"vLLM engine at {self.url} serves no model")
        first = data[0]
        return ServedModel(str(first["id"]), str(first.get("root") or first["id"]), int(first["max_model_len"]))

    async def version(self) -> str:
        return str((await self._get("/version")).json().get("version", "unknown"))

    async def figures(self) -> EngineFigures:
        try:
            return parse_metrics((await self._get("/metrics")).text)
        except MetricsError as exc:
            raise EngineError(f"vLLM engine at {self.url}: {exc}") from None

    async def stream(
        self, model: str, prompt: tuple[int, ...], max_tokens: int, sampling: Sampling, seed: int
    ) -> AsyncIterator[StreamEvent]:
        body = request_body(model, prompt, max_tokens, sampling, seed)
        finish: FinishReason | None = None
        final: StreamEvent | None = None
        try:
            async with self._http.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")[:300]
                    raise EngineError(f"vLLM engine at {self.url} refused the request ({response.status_code}): {text}")
                # read to the end of the stream (its "[DONE]"), so the connection goes back to the pool: one
                # left unread is closed, and every request would open a new one
                async for line in response.aiter_lines():
                    if final is not None or not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = parse_chunk(json.loads(line[len("data: ") :]))
                    if event is None:
                        continue
                    if event.tokens or event.finish_reason is not None:
                        finish = event.finish_reason or finish
                        if event.tokens:
                            yield StreamEvent(event.tokens)
                    else:
                        final = StreamEvent((), finish or FinishReason.ERROR, event.cached_tokens)
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            raise EngineError(f"the stream from the vLLM engine at {self.url} broke ({exc!r})") from None
        if final is None:
            raise EngineError(f"the stream from the vLLM engine at {self.url} ended without its usage")
        yield final
