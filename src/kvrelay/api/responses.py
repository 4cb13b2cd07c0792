"""Response bodies of the OpenAI-compatible endpoints, in OpenAI's shapes.

The app encodes these structs, and the OpenAPI document describes them (``api.openapi``),
so what the schema promises is what the server sends.
"""

from __future__ import annotations

from typing import Literal

from msgspec import Struct

FinishReason = Literal["stop", "length", "error"]


class ErrorDetail(Struct, kw_only=True):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(Struct, kw_only=True):
    """OpenAI's error body: ``param`` names the offending field as a dotted path (``messages.0.role``)."""

    error: ErrorDetail


class PromptTokensDetails(Struct, kw_only=True):
    cached_tokens: int


class Usage(Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionChoice(Struct, kw_only=True):
    index: int
    text: str
    finish_reason: FinishReason | None
    logprobs: None = None


class Completion(Struct, kw_only=True):
    """A whole completion, or one chunk of a streamed one (``usage`` only in the last, when asked for)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(Struct, kw_only=True):
    role: Literal["assistant"]
    content: str


class ChatChoice(Struct, kw_only=True):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: None = None


class ChatCompletion(Struct, kw_only=True):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(Struct, kw_only=True, omit_defaults=True):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(Struct, kw_only=True):
    index: int
    delta: Delta
    finish_reason: FinishReason | None
    logprobs: None = None


class ChatCompletionChunk(Struct, kw_only=True):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class ModelCard(Struct, kw_only=True):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(Struct, kw_only=True):
    object: Literal["list"]
    data: list[ModelCard]


class Health(Struct, kw_only=True):
    """``ok`` (200) while a live worker serves some model, else ``unavailable`` (503)."""

    status: Literal["ok", "unavailable"]
    models: list[str]


SCHEMAS: tuple[type[Struct], ...] = (ErrorBody, Completion, ChatCompletion, ChatCompletionChunk, ModelList, Health)
"""The response bodies the OpenAPI document describes."""
