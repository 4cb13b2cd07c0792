"""Request bodies of the OpenAI-compatible endpoints, decoded strictly as OpenAI's API does.

Each body is a ``msgspec.Struct`` decoded from the JSON bytes in one pass
(``api.body.decode_body``): JSON types are not coerced (``"stream": 0``,
``"temperature": false`` and ``"prompt": [false]`` are errors, an integer is a
valid number), unknown fields are ignored, and a ``null`` optional field takes
its default. JSON cannot carry a lone UTF-16 surrogate past the decoder, so
every decoded text is valid Unicode. The descriptions are the fields' contract:
the OpenAPI document shows them and an invalid field's error quotes its own.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, Struct

MAX_STOPS = 16
"""Stop sequences per request: each is searched for in every new piece of text."""

TokenId = Annotated[int, Meta(ge=0)]
Prompt = Annotated[
    Annotated[str, Meta(min_length=1)] | Annotated[list[TokenId | str], Meta(min_length=1)],
    Meta(description="the text to continue: a non-empty string, an array of token ids, or an array of one string"),
]


class StreamOptions(Struct, kw_only=True):
    include_usage: Annotated[
        bool | None, Meta(description="send a last chunk with the usage (true or false); default false")
    ] = None


class SamplingFields(Struct, kw_only=True):
    """Fields shared by completions and chat completions."""

    model: Annotated[str, Meta(description="the id of a served model (GET /v1/models lists them)")]
    max_tokens: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        Meta(description="most tokens to generate, at least 1; the prompt and these must fit the model's context"),
    ] = None
    max_completion_tokens: Annotated[
        Annotated[int, Meta(ge=1)] | None, Meta(description="the same as max_tokens, which it overrides")
    ] = None
    temperature: Annotated[
        Annotated[float, Meta(ge=0.0, le=2.0)] | None,
        Meta(description="sampling temperature from 0 (greedy) to 2; default 1"),
    ] = None
    top_p: Annotated[
        Annotated[float, Meta(gt=0.0, le=1.0)] | None,
        Meta(description="nucleus sampling: the probability mass kept, above 0 and at most 1; default 1"),
    ] = None
    seed: Annotated[
        int | None, Meta(description="an integer seed: the same request with the same seed samples the same tokens")
    ] = None
    stop: Annotated[
        str | Annotated[list[str | TokenId], Meta(max_length=MAX_STOPS)] | None,
        Meta(description=f"where to stop: a string, or an array of at most {MAX_STOPS} strings and token ids"),
    ] = None
    stream: Annotated[
        bool | None, Meta(description="stream the answer as server-sent events (true or false); default false")
    ] = None
    stream_options: Annotated[
        StreamOptions | None, Meta(description='options of a stream: {"include_usage": true}')
    ] = None
    n: Annotated[
        Annotated[int, Meta(ge=1, le=1)] | None,
        Meta(description="how many choices to return: kvrelay returns one, so n must be 1"),
    ] = None
    user: Annotated[
        Annotated[str, Meta(max_length=256)] | None,
        Meta(description="an id of the end user: while requests wait in the router queue, users share it fairly"),
    ] = None
    priority: Annotated[
        Annotated[int, Meta(ge=-(2**31), le=2**31 - 1)] | None,
        Meta(
            description="the request's class while it waits in the router queue: lower goes first (as in vLLM); "
            "default 0"
        ),
    ] = None

    @property
    def streamed(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: Prompt


class TextPart(Struct, kw_only=True):
    type: Annotated[Literal["text"], Meta(description='the kind of part: only "text" parts are served')]
    text: Annotated[str, Meta(description="the part's text")]


Role = Literal["system", "developer", "user", "assistant", "tool"]


class ChatMessage(Struct, kw_only=True):
    role: Annotated[
        Role,
        Meta(
            description="who speaks: system, developer (read as system), user, assistant, or tool (a tool's "
            "result, read as user)"
        ),
    ]
    content: Annotated[
        str | list[TextPart] | None,
        Meta(description='the message\'s text: a string, or an array of {"type": "text", "text": ...} parts'),
    ] = None

    def text(self) -> str:
        """The message's text; the texts of its parts joined."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(SamplingFields, kw_only=True):
    messages: Annotated[
        list[ChatMessage], Meta(min_length=1, description="the conversation so far, at least one message")
    ]
