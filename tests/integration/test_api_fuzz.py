"""A schema-driven fuzz run of the OpenAI-compatible endpoints: no 500, no hang, every error in OpenAI's format.

Bodies come from hypothesis strategies derived from the request schemas
(``CompletionRequest`` / ``ChatRequest``'s JSON schema): a body satisfying the
schema, then up to two fields left out or replaced by values at or past their
edges (huge and negative numbers, unicode and lone surrogates, token ids
outside the vocabulary, stop lists mixing ints and strings, ``n``) or by junk
of any JSON type; unknown fields and non-object bodies are thrown in too, and
malformed bytes are sent as they are. They go over loopback HTTP to an embedded
server with a tiny model whose context is short, so a valid request generates
at most a few dozen tokens. The same bodies, prepared by the ingress directly,
must also make offers that survive the wire codec (a cluster sends them as
msgpack). The run is derandomized (the same examples every time), bounded to
``EXAMPLES`` bodies, and each request has a timeout, so a hang fails the test
instead of stalling it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrelay.api.errors import APIError
from kvrelay.api.schema import ChatRequest, CompletionRequest
from kvrelay.protocol.codec import decode, encode
from kvrelay.protocol.messages import Assignment, Offer
from kvrelay.testing.tiny_models import make_tiny_model
from tests.support.server_thread import ServerThread

EXAMPLES = 150
CONTEXT = 96
VOCAB = 384
REQUEST_TIMEOUT_S = 30.0
ERROR_STATUSES = {400, 404, 413}

JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
JUNK = st.recursive(
    JSON_SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8,
)
"""Any JSON value, nested: what a broken client might send in place of a field."""
TEXT = st.text(max_size=16)
ODD_TEXT = st.one_of(
    st.text(max_size=64),
    st.text(st.characters(exclude_categories=()), max_size=8),
    st.sampled_from(
        [
            "",
            "\U0001f600 caf\u00e9 \u4e2d\u6587",
            "\x00",
            "<eos>",
            "<start_of_turn>user\n",
            "\ufffd",
            "\u200b" * 40,
            "\ud800",
            "a\udfffb",
        ]
    ),
)
"""Odd text, lone UTF-16 surrogates included (JSON can spell them; they are not valid Unicode)."""
EDGE_INTS = st.sampled_from([0, -1, 2**31, 2**63, 2**64 + 1, 10**30, -(10**30)])
EDGE_FLOATS = st.sampled_from([0.0, 1e-300, 1e-8, 1e300, -1.0, 2.5, -0.0])
TOKEN_IDS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)
ODD_TOKEN_IDS = st.lists(
    st.one_of(st.integers(0, VOCAB - 1), st.integers(-5, -1), st.integers(VOCAB, VOCAB + 5), EDGE_INTS), max_size=12
)


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    return defs[node["$ref"].rsplit("/", 1)[-1]] if "$ref" in node else node


def valid_value(node: dict[str, Any], defs: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values that satisfy the JSON-schema ``node`` (its type, bounds, enum and item count); numbers stay small."""
    node = _resolve(node, defs)
    if "anyOf" in node:
        return st.one_of(*(valid_value(option, defs) for option in node["anyOf"]))
    if "enum" in node:
        return st.sampled_from(node["enum"])
    kind = node.get("type")
    if kind == "string":
        return TEXT
    if kind == "integer":
        if "minimum" in node:
            return st.integers(node["minimum"], node["minimum"] + 24)
        return st.one_of(st.integers(-3, 24), EDGE_INTS)
    if kind == "number":
        low, high = node.get("minimum", node.get("exclusiveMinimum", -2.0)), node.get("maximum", 2.0)
        return st.floats(low, high, exclude_min="exclusiveMinimum" in node)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        items = valid_value(node["items"], defs) if node.get("items") else JSON_SCALARS
        return st.lists(items, min_size=node.get("minItems", 0), max_size=3)
    if kind == "object":
        return valid_object(node, defs, {})
    return JSON_SCALARS


def odd_value(node: dict[str, Any], defs: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values at or past the edges of ``node``: its type with extreme or odd contents, or junk of another type."""
    node = _resolve(node, defs)
    kinds = [_resolve(o, defs).get("type") for o in node["anyOf"]] if "anyOf" in node else [node.get("type")]
    edges: list[st.SearchStrategy[Any]] = [JUNK]
    if "string" in kinds:
        edges.append(ODD_TEXT)
    if "integer" in kinds:
        edges.append(EDGE_INTS)
    if "number" in kinds:
        edges.append(EDGE_FLOATS)
    if "array" in kinds:
        edges.append(st.lists(JUNK, max_size=4))
    if "object" in kinds:
        edges.append(st.dictionaries(st.text(max_size=8), JUNK, max_size=3))
    return st.one_of(*edges)


def valid_object(
    node: dict[str, Any], defs: dict[str, Any], hints: dict[str, st.SearchStrategy[Any]]
) -> st.SearchStrategy[dict[str, Any]]:
    """Objects satisfying ``node``: every required field, some optional ones; ``hints`` override by field name."""
    props = node.get("properties", {})
    required = set(node.get("required", ()))
    field = {k: hints.get(k, valid_value(sub, defs)) for k, sub in props.items()}
    return st.fixed_dictionaries(
        {k: v for k, v in field.items() if k in required},
        optional={k: v for k, v in field.items() if k not in required},
    )


def mutated_object(
    node: dict[str, Any], defs: dict[str, Any], hints: dict[str, st.SearchStrategy[Any]]
) -> st.SearchStrategy[dict[str, Any]]:
    """A valid object with up to two fields replaced by odd values or removed, and maybe an unknown field added."""
    props = node.get("properties", {})

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        body = draw(valid_object(node, defs, hints))
        for key in draw(st.lists(st.sampled_from(sorted(props)), max_size=2, unique=True)):
            if draw(st.integers(0, 4)) == 0:
                body.pop(key, None)
            else:
                body[key] = draw(odd_value(props[key], defs))
        if draw(st.integers(0, 5)) == 0:
            body[draw(st.text(min_size=1, max_size=8))] = draw(JUNK)
        return body

    return build()


def request_bodies(model: str) -> st.SearchStrategy[tuple[str, Any]]:
    """(path, body) pairs for both endpoints, from their schemas; a few bodies are not even objects."""
    hints = {
        "model": st.one_of(st.just(model), st.just(model), st.just(model), st.sampled_from(["gpt-4o", model.upper()])),
        "prompt": st.one_of(TEXT.filter(bool), TOKEN_IDS, st.lists(TEXT.filter(bool), min_size=1, max_size=1)),
        "max_tokens": st.one_of(st.integers(1, 24), st.integers(1, 24), st.integers(1, 24), st.just(CONTEXT)),
        "max_completion_tokens": st.one_of(st.integers(1, 24), st.integers(1, 24), st.just(CONTEXT)),
        "n": st.just(1),
    }
    schemas = {
        "/v1/completions": CompletionRequest.model_json_schema(),
        "/v1/chat/completions": ChatRequest.model_json_schema(),
    }
    odd_prompts = st.fixed_dictionaries(
        {"model": st.just(model), "prompt": st.one_of(ODD_TOKEN_IDS, ODD_TEXT)},
        optional={"max_tokens": st.integers(1, 8), "stream": st.booleans()},
    )
    odd_numbers = st.fixed_dictionaries(
        {"model": st.just(model), "prompt": TEXT.filter(bool), "max_tokens": st.integers(1, 4)},
        optional={
            "seed": st.one_of(EDGE_INTS, st.integers()),
            "stop": st.lists(st.one_of(EDGE_INTS, st.integers(-2, VOCAB + 2), TEXT), max_size=4),
            "temperature": st.one_of(EDGE_FLOATS, st.floats(0.0, 2.0)),
            "top_p": EDGE_FLOATS,
        },
    )
    typed = [
        st.tuples(st.just(path), mutated_object(schema, schema.get("$defs", {}), hints))
        for path, schema in schemas.items()
    ]
    garbage = st.tuples(st.sampled_from(sorted(schemas)), JUNK)
    return st.one_of(
        *typed, *typed, st.tuples(st.just("/v1/completions"), st.one_of(odd_prompts, odd_numbers)), garbage
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("gemma3", tmp_path_factory.mktemp("fuzz-gemma3"), max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    db = tmp_path_factory.mktemp("facts") / "facts.sqlite3"
    with ServerThread(model_dir, f"sqlite:///{db}") as s:
        yield s


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=REQUEST_TIMEOUT_S) as client:
        yield client


def assert_openai_error(response: httpx.Response, sent: Any) -> None:
    assert response.status_code in ERROR_STATUSES, (response.status_code, response.text, sent)
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"], (response.text, sent)
    assert isinstance(error["type"], str) and error["type"], (response.text, sent)
    assert set(error) == {"message", "type", "param", "code"}, (response.text, sent)


def assert_sse(response: httpx.Response, sent: Any) -> None:
    assert response.headers["content-type"].startswith("text/event-stream"), sent
    events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", (response.text[-300:], sent)
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks and all("error" not in c for c in chunks), (chunks, sent)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] in ("stop", "length") and not any(finishes[:-1]), (finishes, sent)


def assert_whole(response: httpx.Response, sent: Any) -> None:
    out = response.json()
    assert out["choices"][0]["finish_reason"] in ("stop", "length"), (out, sent)
    assert out["usage"]["completion_tokens"] >= 1, (out, sent)
    assert out["usage"]["prompt_tokens"] + out["usage"]["completion_tokens"] <= CONTEXT, (out, sent)


@pytest.mark.timeout(300)
def test_fuzzed_bodies_never_get_a_500_or_hang(server: ServerThread, model_dir: Path, http: httpx.Client) -> None:
    seen: dict[int, int] = {}

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )
    @given(request_bodies(model_dir.name))
    def exchange(case: tuple[str, Any]) -> None:
        path, body = case
        response = http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        if response.status_code != 200:
            assert_openai_error(response, body)
        elif response.headers["content-type"].startswith("text/event-stream"):
            assert_sse(response, body)
        else:
            assert_whole(response, body)

    exchange()
    print(f"statuses over {EXAMPLES} fuzzed bodies: {dict(sorted(seen.items()))}")
    assert seen.get(200, 0) >= EXAMPLES // 10, f"too few bodies reached generation: {seen}"
    assert all(seen.get(status, 0) for status in ERROR_STATUSES), f"the run did not exercise the error paths: {seen}"

    assert server.parts is not None
    parts = server.parts
    quiesced = asyncio.run_coroutine_threadsafe(asyncio.wait_for(parts.controller.quiesced.wait(), 30), server.loop)
    assert quiesced.result(35) is True
    server.call(parts.controller.pool.check)


@pytest.mark.parametrize(
    ("content", "content_type"),
    [
        (b"", "application/json"),
        (b"{", "application/json"),
        (b"\xff\xfe\x00garbage", "application/json"),
        (
            b'{"model": "m", "prompt": "\\ud800", "messages": [{"role": "user", "content": "\\udc00"}]}',
            "application/json",
        ),
        (b'{"model": "\\ud800", "prompt": "x", "messages": [{"role": "user", "content": "x"}]}', "application/json"),
        (
            (
                b'{"model": "m", "prompt": [1, 2], "messages": [{"role": "user", "content": [{"type": "text", '
                b'"text": "\\ud800"}]}], "stop": ["\\udfff"]}'
            ),
            "application/json",
        ),
        (b'{"model": "m", "prompt": "x", "temperature": NaN}', "application/json"),
        (b"model=m&prompt=x", "application/x-www-form-urlencoded"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_malformed_bytes_get_a_400_in_openai_format(
    http: httpx.Client, model_dir: Path, path: str, content: bytes, content_type: str
) -> None:
    content = content.replace(b'"m"', json.dumps(model_dir.name).encode())
    response = http.post(path, content=content, headers={"content-type": content_type})
    assert_openai_error(response, content)
    assert response.status_code == 400


def test_every_body_the_ingress_accepts_is_encodable_on_the_wire(server: ServerThread, model_dir: Path) -> None:
    """In a cluster the router sends each request to a worker as msgpack: nothing the ingress accepts may break that."""
    assert server.parts is not None
    ingress = server.parts.ingress
    accepted = 0

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )
    @given(request_bodies(model_dir.name))
    def prepare(case: tuple[str, Any]) -> None:
        nonlocal accepted
        path, body = case
        try:
            if path == "/v1/completions":
                prepared = ingress.prepare_completion(CompletionRequest.model_validate(body))
            else:
                prepared = ingress.prepare_chat(ChatRequest.model_validate(body))
        except (pydantic.ValidationError, APIError):
            return
        accepted += 1
        offer = Offer(
            assignment=Assignment("r", 1),
            worker_id="w",
            epoch=1,
            model=prepared.model.name,
            prompt=tuple(prepared.prompt),
            max_new_tokens=prepared.max_tokens,
            sampling=prepared.sampling,
        )
        assert decode(encode(offer)) == offer, body

    prepare()
    assert accepted >= EXAMPLES // 10
