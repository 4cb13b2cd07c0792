"""The OpenAI-compatible API against the official openai client, on an embedded server with a tiny model."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from kvrelay.models.loading.loader import load_artifacts
from kvrelay.testing.tiny_models import make_tiny_model
from tests.support.server_thread import ServerThread
from tests.support.worker_harness import greedy_reference


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("gemma3", tmp_path_factory.mktemp("api-gemma3"))


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    db = tmp_path_factory.mktemp("facts") / "facts.sqlite3"
    with ServerThread(model_dir, f"sqlite:///{db}") as s:
        yield s


def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_and_health(server: ServerThread, model_dir: Path) -> None:
    models = client(server).models.list()
    assert [m.id for m in models.data] == [model_dir.name]
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_greedy_completion_equals_the_runtime_and_reports_usage(server: ServerThread, model_dir: Path) -> None:
    tokenizer = load_artifacts(model_dir).tokenizer
    prompt = "the quick brown fox jumps over the lazy dog " * 3
    ids = tokenizer.encode(prompt)
    expected = greedy_reference(model_dir, ids, 10)
    out = client(server).completions.create(model=model_dir.name, prompt=prompt, max_tokens=10, temperature=0)
    assert out.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 10
    again = client(server).completions.create(model=model_dir.name, prompt=prompt, max_tokens=10, temperature=0)
    assert again.choices[0].text == out.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens == 64 * ((len(ids) - 1) // 64)


def test_streaming_chat_sync_and_async(server: ServerThread, model_dir: Path) -> None:
    messages = [{"role": "user", "content": "hello there, how are you?"}]
    whole = client(server).chat.completions.create(model=model_dir.name, messages=messages, max_tokens=8, temperature=0)
    stream = client(server).chat.completions.create(
        model=model_dir.name,
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8

    async def async_stream() -> str:
        aclient = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        parts = []
        async for chunk in await aclient.chat.completions.create(
            model=model_dir.name, messages=messages, max_tokens=8, temperature=0, stream=True
        ):
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
        await aclient.close()
        return "".join(parts)

    assert asyncio.run(async_stream()) == text


@pytest.mark.parametrize(
    ("body", "status", "param", "needle"),
    [
        ({"model": "nope", "prompt": "x"}, 404, "model", "served models"),
        ({"prompt": "x"}, 400, "model", "the field is required"),
        ({"model": "M", "prompt": "x", "n": 2}, 400, "n", "n must be 1"),
        ({"model": "M", "prompt": "x", "max_tokens": 0}, 400, "max_tokens", "at least 1"),
        ({"model": "M", "prompt": "x", "max_tokens": 10_000_000}, 413, "max_tokens", "context limit"),
        ({"model": "M", "prompt": "x", "temperature": "hot"}, 400, "temperature", "from 0 (greedy) to 2"),
    ],
)
def test_errors_use_the_openai_format(
    server: ServerThread, model_dir: Path, body: dict, status: int, param: str, needle: str
) -> None:
    if body.get("model") == "M":
        body = {**body, "model": model_dir.name}
    r = httpx.post(server.base_url + "/v1/completions", json=body)
    assert r.status_code == status
    assert r.json()["error"]["param"] == param
    assert needle in r.json()["error"]["message"]


def test_a_disconnecting_stream_releases_its_reservation(server: ServerThread, model_dir: Path) -> None:
    with httpx.stream(
        "POST",
        server.base_url + "/v1/completions",
        json={"model": model_dir.name, "prompt": "a b c d", "max_tokens": 500, "stream": True},
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break
    assert server.parts is not None
    quiesced = server.parts.controller.quiesced
    assert asyncio.run_coroutine_threadsafe(asyncio.wait_for(quiesced.wait(), 30), server.loop).result(35) is True
    assert server.call(lambda: server.parts.controller.pool.num_reserved) == 0


def test_a_token_whose_text_is_held_back_still_streams_a_chunk(server: ServerThread, model_dir: Path) -> None:
    """A stop string that the whole completion begins holds every token's text back until the end; each
    batch of tokens still streams a chunk (empty text), so the first chunk comes with the first token, as
    vLLM's server streams it, and the text arrives whole at the end."""
    tokenizer = load_artifacts(model_dir).tokenizer
    prompt = "one two three four five six"
    expected = tokenizer.decode(greedy_reference(model_dir, tokenizer.encode(prompt), 8), skip_special_tokens=True)
    stream = client(server).completions.create(
        model=model_dir.name, prompt=prompt, max_tokens=8, temperature=0, stream=True, stop=[expected + "\u2603"]
    )
    chunks = [c for c in stream if c.choices]
    texts = [c.choices[0].text for c in chunks]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert len(chunks) >= 3 and set(texts[:-2]) == {""}  # a chunk per batch of tokens, its text held back
    assert texts[-2] == expected and texts[-1] == ""  # the held text, then the finishing chunk
