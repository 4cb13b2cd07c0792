"""Request bodies of the OpenAI-compatible endpoints (pydantic, unknown fields ignored).

Every field's text must be valid Unicode: JSON may spell a lone UTF-16
surrogate (``"\\ud800"``), which no tokenizer can encode and no response can
echo, so such a body is a validation error (a 400 naming the field).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    seed: int | None = None
    stop: str | list[str | int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None

    @field_validator("*", mode="before")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        if _has_lone_surrogate(value):
            raise ValueError(
                "the text holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not valid "
                "Unicode; send each character whole"
            )
        return value


def _has_lone_surrogate(value: Any) -> bool:
    """Whether ``value`` (raw JSON: strings, lists, dicts, keys included) holds a surrogate code point."""
    if isinstance(value, str):
        return any("\ud800" <= c <= "\udfff" for c in value)
    if isinstance(value, list):
        return any(_has_lone_surrogate(v) for v in value)
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    return False


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] = ""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = ""

    def text(self) -> str:
        """The message's text; content parts of type ``text`` are joined."""
        if isinstance(self.content, list):
            return "".join(str(p.get("text", "")) for p in self.content if p.get("type") == "text")
        return self.content or ""


class ChatRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
