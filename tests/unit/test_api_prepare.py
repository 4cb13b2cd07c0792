"""The ingress turns decoded bodies into prepared requests: prompts of every form, chats of every role, and the
refusals (each a 4xx naming the field), with a real tiny tokenizer and a real router."""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvrelay.api.app import create_app
from kvrelay.api.body import body_limit
from kvrelay.api.errors import APIError
from kvrelay.api.ingress import INLINE_PREPARE_BYTES, Ingress, Prepared
from kvrelay.api.metrics import Metrics
from kvrelay.api.served_model import CUT_SLACK, PROBE_CHARS_PER_TOKEN, ServedModel
from kvrelay.cli import router as router_cli
from kvrelay.cli import serve as serve_cli
from kvrelay.core.router.events import Outcome, Request
from kvrelay.core.router.machine import new_router
from kvrelay.launch.config import resolve
from kvrelay.models.loading.loader import load_artifacts
from kvrelay.protocol.messages import FinishReason, Usage
from kvrelay.router.cluster_router import ClusterRouter, Consumer
from kvrelay.testing.tiny_models import BOS_ID, make_tiny_model
from tests.support.bench_smoke import run_bench

CONTEXT = 128


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_artifacts(make_tiny_model("llama", tmp_path_factory.mktemp("prepare"))).tokenizer


@pytest.fixture
def ingress(tokenizer: Any) -> Iterator[Ingress]:
    served = ServedModel("m", tokenizer, "llama", CONTEXT, (1,))
    ingress = Ingress(ClusterRouter(new_router(), lambda w, m: None), {"m": served}, Metrics(), lambda name: True)
    yield ingress
    ingress.close()


def completion(ingress: Ingress, **fields: Any) -> Prepared:
    return ingress._completion(json.dumps({"model": "m", "max_tokens": 1, **fields}).encode())[1]


def chat(ingress: Ingress, messages: list[dict[str, Any]], **fields: Any) -> Prepared:
    return ingress._chat(json.dumps({"model": "m", "max_tokens": 1, "messages": messages, **fields}).encode())[1]


def refusal(call: Any, *args: Any, **fields: Any) -> APIError:
    with pytest.raises(APIError) as caught:
        call(*args, **fields)
    return caught.value


def test_a_prompt_is_text_token_ids_or_one_string(ingress: Ingress, tokenizer: Any) -> None:
    ids = tokenizer("hello world").input_ids
    assert completion(ingress, prompt="hello world").prompt == ids
    assert completion(ingress, prompt=["hello world"]).prompt == ids
    assert completion(ingress, prompt=[5, 6, 7]).prompt == [5, 6, 7]


@pytest.mark.parametrize(
    ("prompt", "status", "needle"),
    [
        ([5, "x"], 400, "mixes token ids and strings"),
        (["a", "b"], 400, "holds 2 strings; kvrelay takes one prompt per request"),
        ([""], 400, "the prompt is empty"),
        ([5, 384], 400, "outside the vocabulary of 'm' (ids 0 to 383)"),
        ("word " * 200, 413, "the context limit of 'm' is 128 tokens"),
    ],
)
def test_a_prompt_that_cannot_be_served_names_prompt(ingress: Ingress, prompt: Any, status: int, needle: str) -> None:
    error = refusal(completion, ingress, prompt=prompt)
    assert (error.status, error.param, needle in error.message) == (status, "prompt", True), error.message


def test_max_tokens_past_the_context_says_how_many_fit(ingress: Ingress) -> None:
    error = refusal(completion, ingress, prompt=[5] * 100, max_tokens=29)
    assert (error.status, error.param) == (413, "max_tokens") and "ask for at most 28 tokens" in error.message
    error = refusal(completion, ingress, prompt=[5] * 100, max_completion_tokens=29)
    assert error.param == "max_completion_tokens"


def test_a_long_text_is_refused_from_its_head_and_a_dense_one_that_fits_is_not(
    ingress: Ingress, tokenizer: Any
) -> None:
    probe = CONTEXT * PROBE_CHARS_PER_TOKEN
    sparse = "word " * (2 * probe)
    error = refusal(completion, ingress, prompt=sparse)
    assert error.status == 413 and "more than" in error.message
    head = len(tokenizer(sparse[:probe]).input_ids)
    assert head > CONTEXT + CUT_SLACK and f"more than {head - CUT_SLACK:,} tokens" in error.message
    dense = "<start_of_turn>" * (CONTEXT - 8)  # 15 characters a token: longer than the probe, within the context
    assert len(dense) > probe
    assert completion(ingress, prompt=dense).prompt == tokenizer(dense).input_ids


def test_a_system_only_chat_keeps_its_text(ingress: Ingress, tokenizer: Any) -> None:
    system = " ".join(["rule"] * 15)
    prepared = chat(ingress, [{"role": "system", "content": system}])
    alone = len(tokenizer(system, add_special_tokens=False).input_ids)
    assert len(prepared.prompt) > alone
    assert system in tokenizer.decode(prepared.prompt)
    as_user = chat(ingress, [{"role": "user", "content": system}])
    assert prepared.prompt == as_user.prompt and prepared.prompt[0] == BOS_ID


def test_developer_is_system_and_tool_is_said_by_the_user(ingress: Ingress, tokenizer: Any) -> None:
    developer = chat(ingress, [{"role": "developer", "content": "D"}, {"role": "user", "content": "U"}])
    system = chat(ingress, [{"role": "system", "content": "D"}, {"role": "user", "content": "U"}])
    assert developer.prompt == system.prompt
    tool = tokenizer.decode(
        chat(ingress, [{"role": "user", "content": "U"}, {"role": "tool", "content": "T"}]).prompt,
        skip_special_tokens=False,
    )
    assert "tool" not in tool and "U\n\nT" in tool


def test_a_template_that_rejects_the_conversation_is_a_400_naming_messages(ingress: Ingress, tokenizer: Any) -> None:
    template = tokenizer.chat_template
    tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    try:
        error = refusal(chat, ingress, [{"role": "user", "content": "U"}])
    finally:
        tokenizer.chat_template = template
    assert (error.status, error.param) == (400, "messages")
    assert error.message == "the chat template of 'm' rejects these messages: roles must alternate"


def test_null_fields_take_their_defaults(ingress: Ingress) -> None:
    prepared = completion(ingress, prompt="hi", temperature=None, top_p=None, stop=None, seed=None, n=None)
    assert (prepared.sampling.temperature, prepared.sampling.top_p, prepared.stop_strings) == (1.0, 1.0, ())
    stops = completion(ingress, prompt="hi", stop=["x", "", 7]).sampling.stop_token_ids
    assert stops == (7, 1)


def test_priority_and_user_reach_the_router_queue_in_both_bodies(ingress: Ingress) -> None:
    prepared = completion(ingress, prompt="hi", priority=-3, user="alice")
    assert (prepared.priority, prepared.user) == (-3, "alice")
    prepared = chat(ingress, [{"role": "user", "content": "hi"}], priority=7, user="bob")
    assert (prepared.priority, prepared.user) == (7, "bob")
    assert (completion(ingress, prompt="hi", priority=None).priority, completion(ingress, prompt="hi").user) == (0, "")
    error = refusal(completion, ingress, prompt="hi", priority=2**40)
    assert (error.status, error.param) == (400, "priority"), error.message


def test_a_small_body_is_prepared_on_the_loop_and_a_large_one_on_a_prepare_thread(
    ingress: Ingress, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both give the same request; only where the work runs differs (the module contract)."""
    threads: list[str] = []
    prepare = Ingress.prepare_completion

    def recorded(self: Ingress, body: Any) -> Prepared:
        threads.append(threading.current_thread().name)
        return prepare(self, body)

    monkeypatch.setattr(Ingress, "prepare_completion", recorded)
    small = json.dumps({"model": "m", "max_tokens": 1, "prompt": "hello world", "seed": 7}).encode()
    large = small[:-1] + b" " * INLINE_PREPARE_BYTES + b"}"  # the same request, past the bound by its whitespace
    loop_thread = threading.current_thread().name
    results = asyncio.run(gather_prepared(ingress, [small, large]))
    assert threads[0] == loop_thread and threads[1].startswith("kvrelay-prepare")
    assert results[0] == results[1]


async def gather_prepared(ingress: Ingress, bodies: list[bytes]) -> list[Prepared]:
    return [(await ingress.completion(body))[1] for body in bodies]


def test_the_body_bound_comes_from_the_contexts_unless_configured(tokenizer: Any) -> None:
    served = ServedModel("m", tokenizer, "llama", CONTEXT)
    router = ClusterRouter(new_router(), lambda w, m: None)
    derived = Ingress(router, {"m": served}, Metrics(), lambda name: True)
    configured = Ingress(router, {"m": served}, Metrics(), lambda name: True, max_body_bytes=1_000)
    try:
        assert derived.body_limit() == body_limit([CONTEXT]) and configured.body_limit() == 1_000
    finally:
        derived.close()
        configured.close()


def test_kvrelay_router_and_serve_take_the_body_bound() -> None:
    parser = argparse.ArgumentParser()
    router_cli.add_arguments(parser)
    values = resolve(parser.parse_args([]), router_cli.COMMAND, router_cli.OPTIONS, {"KVRELAY_MAX_BODY_BYTES": "5000"})
    assert values["max_body_bytes"] == 5000
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    assert parser.parse_args(["--max-body-bytes", "7000"]).max_body_bytes == 7000


def test_ingress_lag_bench_smoke(tmp_path: Path, tokenizer: Any) -> None:
    model = Path(tokenizer.name_or_path)
    args = ["--model", str(model), "--text-bytes", "20000", "--turns", "50", "--rounds", "1", "--processes", "1"]
    code, figures = run_bench("ingress_lag.py", args, tmp_path / "lag.json")
    assert code == 0 and len(figures) == 12


def test_an_unexpected_failure_is_a_500_in_openai_format(ingress: Ingress, monkeypatch: pytest.MonkeyPatch) -> None:
    async def failing(raw: bytes) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(ingress, "completion", failing)
    transport = httpx.ASGITransport(app=create_app(ingress), raise_app_exceptions=False)

    async def call() -> httpx.Response:
        async with httpx.AsyncClient(transport=transport, base_url="http://kvrelay") as client:
            return await client.post("/v1/completions", json={"model": "m", "prompt": "x"})

    response = asyncio.run(call())
    assert response.status_code == 500
    assert response.json() == {
        "error": {
            "message": "the server failed on this request (RuntimeError)",
            "type": "server_error",
            "param": None,
            "code": None,
        }
    }


class CapturingRouter(ClusterRouter):
    """A real router whose submitted requests are held here instead of routed, with their consumers."""

    def __init__(self) -> None:
        super().__init__(new_router(), lambda w, m: None)
        self.consumers: dict[str, Consumer] = {}
        self.submitted = asyncio.Event()

    def submit(self, request: Request, consumer: Consumer) -> None:
        self.consumers[request.request_id] = consumer
        self.submitted.set()


def test_deltas_that_queue_while_the_response_is_written_are_relayed_as_one(tokenizer: Any) -> None:
    router = CapturingRouter()
    ingress = Ingress(router, {"m": ServedModel("m", tokenizer, "llama", CONTEXT, (1,))}, Metrics(), lambda n: True)
    words = [tokenizer.encode(w, add_special_tokens=False) for w in (" one", " two", " three", " four")]

    async def scenario() -> list[Any]:
        events = ingress.generate(completion(ingress, prompt="count"), "r1")
        first = asyncio.ensure_future(events.__anext__())
        await asyncio.wait_for(router.submitted.wait(), 5)
        consumer = router.consumers["r1"]
        consumer.on_delta(0, tuple(words[0]))
        got = [await asyncio.wait_for(first, 5)]  # the only delta so far
        for k, word in enumerate(words[1:], 1):  # three more arrive while the client is being written to
            consumer.on_delta(k, tuple(word))
        got.append(await events.__anext__())
        tokens = tuple(t for w in words for t in w)
        consumer.on_result(Outcome("r1", FinishReason.LENGTH, tokens, 1, Usage(prompt_tokens=2)))
        got.append(await events.__anext__())
        return got

    try:
        first, rest, final = asyncio.run(scenario())
    finally:
        ingress.close()
    assert first.text == " one" and rest.text == " two three four"
    assert rest.tokens == tuple(t for w in words[1:] for t in w)
    assert final.finish_reason == "length" and final.completion_tokens == sum(len(w) for w in words)
