"""Request bodies decode strictly, and every way a body can be wrong is a 400 naming the field and the fix."""

from __future__ import annotations

import json
from functools import partial

import pytest

from kvrelay.api.body import BODY_BYTES_PER_TOKEN, BODY_OVERHEAD_BYTES, body_limit, decode_body, json_path_at
from kvrelay.api.errors import APIError
from kvrelay.api.openapi import describe
from kvrelay.api.schema import ChatRequest, CompletionRequest

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}


def error_of(raw: bytes, kind: type = CompletionRequest) -> APIError:
    with pytest.raises(APIError) as caught:
        decode_body(raw, kind, partial(describe, kind))
    assert caught.value.status == 400
    assert caught.value.body()["error"]["type"] == "invalid_request_error"
    return caught.value


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("depth", [350, 900])
@pytest.mark.parametrize(
    ("field", "param"), [("messages", "messages.0"), ("stop", "stop.0"), ("user", "user"), ("seed", "seed")]
)
def test_deep_nesting_in_a_field_is_a_400_naming_it(depth: int, field: str, param: str) -> None:
    body = dict(CHAT)
    body[field] = "NESTED"
    raw = json.dumps(body).replace('"NESTED"', nested(depth)).encode()
    assert error_of(raw, ChatRequest).param == param


def test_nesting_too_deep_to_decode_names_the_top_level_field() -> None:
    raw = json.dumps({**COMPLETION, "extra": "NESTED"}).replace('"NESTED"', nested(20_000)).encode()
    error = error_of(raw)
    assert error.param == "extra" and "too deeply" in error.message


@pytest.mark.parametrize(
    ("raw", "param", "needle"),
    [
        (b'{"model": "m", "prompt": "caf\xe9"}', "prompt", "not valid UTF-8 (byte 29)"),
        (b'{"model": "m", "prompt": "hi",}', "prompt", "trailing comma"),
        (b'{"model": "m", "prompt": "hi" "stop": "x"}', "prompt", "not valid JSON"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"]}', "messages.0.content", "not valid JSON"),
        (b'{"model": "m", "prompt": "hi"', None, "ends inside its JSON value"),
        (b'{"model": "m", "prompt": "\\ud800"}', "prompt", "lone UTF-16 surrogate (\\ud800)"),
        (b'{"model": "m", "prompt": "x\\udc00y"}', "prompt", "lone UTF-16 surrogate (\\udc00)"),
        (b'{"model": "m", "stop": ["\\ud83d\\ude00", "\\udfff"], "prompt": "x"}', "stop.1", "lone UTF-16"),
        (b'{"model": "m", "prompt": "x", "temperature": NaN}', "temperature", "not valid JSON"),
        (b"", None, "the request body is empty"),
        (b"model=m&prompt=x", None, "not valid JSON"),
    ],
)
def test_a_body_that_is_not_json_names_where_it_breaks(raw: bytes, param: str | None, needle: str) -> None:
    error = error_of(raw, ChatRequest if b"messages" in raw else CompletionRequest)
    assert (error.param, needle in error.message) == (param, True), error.message


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({**COMPLETION, "stream": 0}, "stream", "expected `boolean | null`, got `integer`"),
        ({**COMPLETION, "temperature": False}, "temperature", "expected `number | null`, got `boolean`"),
        ({**COMPLETION, "temperature": 3}, "temperature", "from 0 (greedy) to 2"),
        ({**COMPLETION, "max_tokens": 5.0}, "max_tokens", "got `number`"),
        ({**COMPLETION, "seed": "7"}, "seed", "expected `integer | null`, got `string`"),
        ({**COMPLETION, "n": 2}, "n", "n must be 1"),
        ({"model": "m", "prompt": [False]}, "prompt.0", "got `boolean`"),
        ({"model": "m", "prompt": 5}, "prompt", "expected `string | array`, got `integer`"),
        ({"model": "m", "prompt": []}, "prompt", "a non-empty string, an array of token ids"),
        ({"model": "m", "prompt": [-1]}, "prompt.0", ">= 0"),
        ({"prompt": "x"}, "model", "the field is required"),
        ({**COMPLETION, "stop": ["a"] * 17}, "stop", "at most 16"),
        ({**COMPLETION, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage", "true or false"),
        ({"model": "m"}, "prompt", "the field is required"),
    ],
)
def test_a_field_of_the_wrong_type_or_range_is_named_with_its_contract(body: dict, param: str, needle: str) -> None:
    error = error_of(json.dumps(body).encode())
    assert (error.param, needle in error.message) == (param, True), error.message


@pytest.mark.parametrize(
    ("messages", "param", "needle"),
    [
        ([], "messages", "at least one message"),
        ([{"role": "bot", "content": "x"}], "messages.0.role", "invalid enum value 'bot'"),
        ([{"content": "x"}], "messages.0.role", "the field is required"),
        ([{"role": "user", "content": 5}], "messages.0.content", '{"type": "text", "text": ...}'),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages.0.content.0.type", 'only "text" parts'),
        ([{"role": "user", "content": [{"type": "text"}]}], "messages.0.content.0.text", "the field is required"),
    ],
)
def test_a_bad_message_is_named_by_its_path(messages: list, param: str, needle: str) -> None:
    error = error_of(json.dumps({"model": "m", "messages": messages}).encode(), ChatRequest)
    assert (error.param, needle in error.message) == (param, True), error.message


def test_a_body_that_is_not_an_object_is_a_400_for_the_body() -> None:
    error = error_of(b"[1, 2]")
    assert error.param is None and "expected `object`, got `array`" in error.message


def test_valid_bodies_decode_with_nulls_as_defaults_and_unknown_fields_ignored() -> None:
    raw = json.dumps(
        {**COMPLETION, "temperature": None, "stream": None, "n": 1, "logit_bias": {"1": 5}, "prompt": [1, 2]}
    )
    body = decode_body(raw.encode(), CompletionRequest, partial(describe, CompletionRequest))
    assert (body.prompt, body.temperature, body.streamed, body.include_usage) == ([1, 2], None, False, False)
    chat = decode_body(
        json.dumps({**CHAT, "messages": [{"role": "tool", "content": [{"type": "text", "text": "a"}] * 2}]}).encode(),
        ChatRequest,
        partial(describe, ChatRequest),
    )
    assert chat.messages[0].text() == "aa"


@pytest.mark.parametrize(
    ("raw", "offset", "path"),
    [
        (b'{"a": {"b": [1, 2, {"c": "x"}]}}', 25, "a.b.2.c"),
        (b'{"a": {"b": [1, 2, {"c": "x"}]}}', 16, "a.b.1"),
        (b'{"a": "}{][", "b": 1}', 18, "b"),
        (b'{"a\\"q": [', 9, 'a"q'),
        (b"[[", 2, "0.0"),
        (b"  ", 1, None),
    ],
)
def test_json_path_at_names_the_value_an_offset_lies_in(raw: bytes, offset: int, path: str | None) -> None:
    assert json_path_at(raw, offset) == path


def test_the_body_bound_follows_the_largest_context() -> None:
    assert body_limit([512, 32768]) == 32768 * BODY_BYTES_PER_TOKEN + BODY_OVERHEAD_BYTES
    assert body_limit([]) == BODY_OVERHEAD_BYTES
