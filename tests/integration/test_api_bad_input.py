"""Bad input over real HTTP to an embedded server: every refusal is a 4xx in OpenAI's error format naming the field,
nothing is coerced, the OpenAPI document says what the server answers, and the server keeps serving.

The tiny Gemma 3 model is served with the Gemma chat template kvrelay gives the
real Gemma 3 270M, whose system message opens the first user turn.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest

from kvrelay.api.responses import ChatCompletionChunk, Completion
from kvrelay.models.loading.tokenizer import GEMMA_CHAT_TEMPLATE
from kvrelay.testing.tiny_models import make_tiny_model
from tests.support.server_thread import ServerThread

CONTEXT = 512


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = make_tiny_model("gemma3", tmp_path_factory.mktemp("bad-input"), max_position_embeddings=CONTEXT)
    (directory / "chat_template.jinja").write_text(GEMMA_CHAT_TEMPLATE)
    return directory


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    db = tmp_path_factory.mktemp("facts") / "facts.sqlite3"
    with ServerThread(model_dir, f"sqlite:///{db}") as s:
        yield s


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


def openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def post(http: httpx.Client, path: str, raw: bytes) -> httpx.Response:
    return http.post(path, content=raw, headers={"content-type": "application/json"})


@pytest.mark.parametrize("depth", [350, 900])
@pytest.mark.parametrize(("field", "param"), [("messages", "messages.0"), ("stop", "stop.0"), ("user", "user")])
def test_deeply_nested_fields_are_a_400_naming_them(
    http: httpx.Client, model_dir: Path, depth: int, field: str, param: str
) -> None:
    body = {"model": model_dir.name, "messages": [{"role": "user", "content": "hi"}], field: "NESTED"}
    raw = json.dumps(body).replace('"NESTED"', "[" * depth + "]" * depth).encode()
    assert openai_error(post(http, "/v1/chat/completions", raw), 400)["param"] == param


@pytest.mark.parametrize(
    ("raw", "param", "needle"),
    [
        (b'{"model": "m", "prompt": "x", "extra": ' + b"[" * 20_000 + b"]" * 20_000 + b"}", "extra", "too deeply"),
        (b'{"model": "m", "prompt": "caf\xe9"}', "prompt", "not valid UTF-8"),
        (b'{"model": "m", "prompt": "x",}', "prompt", "trailing comma"),
        (b'{"model": "m", "prompt": "\\ud800"}', "prompt", "lone UTF-16 surrogate"),
        (b'{"model": "m", "prompt": 5}', "prompt", "expected `string | array`, got `integer`"),
        (b'{"model": "m", "prompt": []}', "prompt", "a non-empty string, an array of token ids"),
        (b'{"model": "m", "prompt": "x", "stream": 0}', "stream", "got `integer`"),
        (b'{"model": "m", "prompt": "x", "temperature": false}', "temperature", "got `boolean`"),
        (b'{"model": "m", "prompt": [false]}', "prompt.0", "got `boolean`"),
        (b"", None, "the request body is empty"),
        (b"model=m&prompt=x", None, "not valid JSON"),
    ],
)
def test_malformed_bodies_are_a_400_in_openai_format_naming_the_field(
    http: httpx.Client, model_dir: Path, raw: bytes, param: str | None, needle: str
) -> None:
    error = openai_error(post(http, "/v1/completions", raw.replace(b'"m"', json.dumps(model_dir.name).encode())), 400)
    assert (error["param"], needle in error["message"]) == (param, True), error
    assert not (error["param"] or "").isdigit()


def test_a_system_only_chat_is_answered_from_its_text(http: httpx.Client, model_dir: Path) -> None:
    system = " ".join(["rule"] * 40)
    body = {"model": model_dir.name, "max_tokens": 1, "messages": [{"role": "system", "content": system}]}
    usage = http.post("/v1/chat/completions", json=body).json()["usage"]
    as_user = {**body, "messages": [{"role": "user", "content": system}]}
    assert usage["prompt_tokens"] > 40
    assert usage["prompt_tokens"] == http.post("/v1/chat/completions", json=as_user).json()["usage"]["prompt_tokens"]


def test_a_body_past_the_bound_is_refused_before_it_is_read(http: httpx.Client, model_dir: Path) -> None:
    declared = post(http, "/v1/completions", json.dumps({"model": model_dir.name, "prompt": "x" * 200_000}).encode())
    assert openai_error(declared, 413)["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:
        yield b'{"model": "m", "prompt": "'
        for _ in range(1_000):
            yield b"x" * 1_000
        yield b'"}'

    streamed = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in streamed.request.headers
    error = openai_error(streamed, 413)
    assert error["code"] == "request_too_large" and "goes on past that" in error["message"]
    ok = http.post("/v1/completions", json={"model": model_dir.name, "prompt": "hello", "max_tokens": 2})
    assert ok.status_code == 200


def test_wrong_routes_and_methods_answer_in_openai_format(http: httpx.Client) -> None:
    assert openai_error(http.get("/v2/nothing"), 404)["code"] == "not_found"
    wrong_method = http.put("/v1/completions")
    assert openai_error(wrong_method, 405)["code"] == "method_not_allowed"
    assert wrong_method.headers["allow"] == "POST"


def test_the_openapi_document_describes_what_the_server_answers(http: httpx.Client) -> None:
    document = http.get("/openapi.json").json()
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            statuses = set(operation["responses"])
            assert "422" not in statuses, (method, path)
            for status in statuses - {"200", "503"}:
                schema = operation["responses"][status]["content"]["application/json"]["schema"]
                assert schema == {"$ref": "#/components/schemas/ErrorBody"}, (method, path, status)
    for path in ("/v1/completions", "/v1/chat/completions"):
        post_doc = document["paths"][path]["post"]
        assert {"400", "404", "413", "429", "503"} <= set(post_doc["responses"])
        assert post_doc["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("Request")
    assert set(document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert http.get("/metrics").headers["content-type"].startswith("text/plain")


@pytest.mark.parametrize(
    ("path", "extra", "chunk"),
    [
        ("/v1/completions", {"prompt": "hello"}, Completion),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}]}, ChatCompletionChunk),
    ],
)
def test_streamed_events_are_the_documented_chunks(
    http: httpx.Client, model_dir: Path, path: str, extra: dict, chunk: type
) -> None:
    """schemathesis found the event stream documented as one string: in OpenAPI 3.1 its schema is one event's."""
    document = http.get("/openapi.json").json()
    event = document["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
    carried = event["else"]["properties"]["data"]["contentSchema"]["anyOf"]
    assert carried == [{"$ref": f"#/components/schemas/{chunk.__name__}"}, {"$ref": "#/components/schemas/ErrorBody"}]
    body = {"model": model_dir.name, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", path, json={**body, **extra}) as response:
        data = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [msgspec.json.decode(d, type=chunk) for d in data[:-1]]
    assert chunks[-1].usage is not None and chunks[-1].choices == []
