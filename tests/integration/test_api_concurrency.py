"""64 concurrent streaming clients against an embedded server, a seeded random third disconnecting mid-stream.

The clients that stay must receive exactly the non-streaming greedy answer for
their prompt (text, finish reason and token count); every client that leaves
must be counted as a disconnect, which cancels its request through the router
to the worker; afterwards the worker holds no reservation and its page pool is
consistent. The seed is printed; ``KVRELAY_TEST_SEED`` replays a run. A client
that vanishes before its first token (streaming or not) is cancelled the same
way, and the server logs no error for it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import re
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from kvrelay.testing.tiny_models import make_tiny_model
from tests.support.server_thread import ServerThread

CLIENTS = 64
MAX_TOKENS = 12
LEAVER_MAX_TOKENS = 400
"""Long enough that a leaver's request is still generating when its disconnect reaches the server."""
LONG_PROMPTS = [
    "A paged key value cache keeps",
    "Routers send each request to",
    "the quick brown fox jumps over",
    "Hello, world! How are you",
    "Paris and Rome are capitals of",
    "fixed size pages hold attention state",
]
"""Prompts whose greedy continuation by the seed-0 tiny Gemma 3 has no end-of-sequence token in 400 tokens."""
PROMPTS = [*LONG_PROMPTS, "The capital of France is", "0123456789 the lazy dog"]
"""The last two end early (end of sequence within ``MAX_TOKENS``), so finish_reason "stop" is exercised too."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("gemma3", tmp_path_factory.mktemp("concurrency-gemma3"))


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    db = tmp_path_factory.mktemp("facts") / "facts.sqlite3"
    with ServerThread(model_dir, f"sqlite:///{db}") as s:
        yield s


@dataclass(frozen=True)
class Answer:
    text: str
    finish_reason: str | None
    completion_tokens: int


@dataclass(frozen=True)
class Left:
    chunks: int


def metric(text: str, name: str) -> float:
    """The sum of every series of ``name`` in a Prometheus exposition (0 when absent)."""
    values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    return sum(float(v) for v in values)


async def reference_answers(aclient: openai.AsyncOpenAI, model: str) -> dict[str, Answer]:
    answers = {}
    for prompt in PROMPTS:
        out = await aclient.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert out.usage is not None
        answers[prompt] = Answer(out.choices[0].text, out.choices[0].finish_reason, out.usage.completion_tokens)
    return answers


async def stay(aclient: openai.AsyncOpenAI, model: str, prompt: str) -> Answer:
    stream = await aclient.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, tokens = [], None, -1
    async for chunk in stream:
        if chunk.choices:
            text.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return Answer("".join(text), finish, tokens)


async def leave(hclient: httpx.AsyncClient, model: str, prompt: str, after_chunks: int) -> Left:
    """Read ``after_chunks`` SSE chunks, then close the connection mid-stream."""
    body = {"model": model, "prompt": prompt, "max_tokens": LEAVER_MAX_TOKENS, "temperature": 0, "stream": True}
    seen = 0
    async with hclient.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            assert chunk["choices"][0]["finish_reason"] is None, "a leaver's request finished before it left"
            seen += 1
            if seen >= after_chunks:
                break
    return Left(seen)


def test_concurrent_streams_with_disconnects_complete_and_release_every_reservation(
    server: ServerThread, model_dir: Path
) -> None:
    seed = int(os.environ.get("KVRELAY_TEST_SEED", random.SystemRandom().randrange(2**32)))
    print(f"test_api_concurrency seed={seed} (set KVRELAY_TEST_SEED={seed} to replay)")
    rng = random.Random(seed)
    leavers = set(rng.sample(range(CLIENTS), CLIENTS // 3))
    plan = [(rng.choice(LONG_PROMPTS if i in leavers else PROMPTS), rng.randint(1, 3)) for i in range(CLIENTS)]
    model = model_dir.name
    before = httpx.get(server.base_url + "/metrics", timeout=10).text
    assert server.parts is not None
    parts = server.parts
    worker_before = server.call(lambda: dict(parts.controller.state.counters))

    async def main() -> tuple[dict[str, Answer], list[Answer | Left]]:
        aclient = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        hclient = httpx.AsyncClient(base_url=server.base_url, timeout=120)
        try:
            expected = await reference_answers(aclient, model)
            runs = [
                leave(hclient, model, prompt, k) if i in leavers else stay(aclient, model, prompt)
                for i, (prompt, k) in enumerate(plan)
            ]
            results = await asyncio.wait_for(asyncio.gather(*runs), 240)
            return expected, results
        finally:
            await aclient.close()
            await hclient.aclose()

    expected, results = asyncio.run(main())
    for i, ((prompt, k), result) in enumerate(zip(plan, results, strict=True)):
        if i in leavers:
            assert result == Left(k), f"client {i} ({prompt!r})"
        else:
            assert result == expected[prompt], f"client {i} ({prompt!r})"
    assert all(a.completion_tokens >= 1 and a.finish_reason in ("length", "stop") for a in expected.values())

    quiesced = asyncio.run_coroutine_threadsafe(asyncio.wait_for(parts.controller.quiesced.wait(), 60), server.loop)
    assert quiesced.result(65) is True
    assert server.call(lambda: parts.controller.pool.num_reserved) == 0
    server.call(parts.controller.pool.check)
    worker_after = server.call(lambda: dict(parts.controller.state.counters))
    moved = {k: worker_after.get(k, 0) - worker_before.get(k, 0) for k in ("cancelled", "finished")}
    assert moved == {"cancelled": len(leavers), "finished": CLIENTS - len(leavers) + len(PROMPTS)}, (
        "every leaver's request is cancelled at the worker while running; every other one finishes"
    )

    after = httpx.get(server.base_url + "/metrics", timeout=10).text
    assert re.search(r'^kvrelay_pages_reserved\{worker="[^"]+"\} 0(?:\.0)?$', after, re.MULTILINE)
    assert metric(after, "kvrelay_ttft_seconds_count") >= metric(before, "kvrelay_ttft_seconds_count") + CLIENTS
    assert 'kvrelay_ttft_seconds_bucket{le="+Inf"}' in after
    disconnects = metric(after, "kvrelay_client_disconnects_total") - metric(before, "kvrelay_client_disconnects_total")
    assert disconnects == len(leavers)
    requests = metric(after, "kvrelay_requests_total") - metric(before, "kvrelay_requests_total")
    assert requests == CLIENTS + len(PROMPTS)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_gone_before_its_first_token_is_cancelled_without_a_server_error(
    server: ServerThread, model_dir: Path, stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    assert server.parts is not None
    parts = server.parts
    cancels, offered = threading.Event(), threading.Event()
    original, original_offer = parts.controller.on_cancel, parts.controller.on_offer

    def on_cancel(message: object) -> None:
        original(message)  # type: ignore[arg-type]
        cancels.set()

    def on_offer(offer: object, reply: object) -> None:
        original_offer(offer, reply)  # type: ignore[arg-type]
        offered.set()

    before = server.call(lambda: dict(parts.controller.state.counters))
    body = json.dumps(
        {
            "model": model_dir.name,
            "prompt": LONG_PROMPTS[0],
            "max_tokens": LEAVER_MAX_TOKENS,
            "temperature": 0,
            "stream": stream,
        }
    ).encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % len(body)
    ) + body
    server_log = logging.getLogger("uvicorn.error")
    server_log.addHandler(caplog.handler)
    server.call(setattr, parts.controller, "on_cancel", on_cancel)
    server.call(setattr, parts.controller, "on_offer", on_offer)
    try:
        with socket.create_connection(("127.0.0.1", server.options.port)) as sock:
            sock.sendall(request)
            # Leave once the worker has the request: a client gone earlier ends it at the router alone
            # (an outcome with 0 attempts), which is not what this test is about.
            assert offered.wait(60), "the request never reached the worker"
        assert cancels.wait(60), "the request of a vanished client was never cancelled at the worker"
        quiesced = asyncio.run_coroutine_threadsafe(asyncio.wait_for(parts.controller.quiesced.wait(), 30), server.loop)
        assert quiesced.result(35) is True
    finally:
        server.call(delattr, parts.controller, "on_cancel")
        server.call(delattr, parts.controller, "on_offer")
        server_log.removeHandler(caplog.handler)
    after = server.call(lambda: dict(parts.controller.state.counters))
    assert after.get("cancelled", 0) - before.get("cancelled", 0) == 1
    assert after.get("finished", 0) == before.get("finished", 0)
    assert server.call(lambda: parts.controller.pool.num_reserved) == 0
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
