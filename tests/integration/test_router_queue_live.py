"""The router queue live: a `kvrelay router` process and a worker process, the official openai client.

The worker is stopped (SIGSTOP) once it holds one request, so the router knows it busy: with a start bound of
0 s every later request waits at the router, two fit the queue, the rest are refused at once with a 429 in
OpenAI's format and a Retry-After header. When the worker resumes, every admitted request completes: each
request gets exactly one answer.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from kvrelay.testing.tiny_models import make_tiny_model
from tests.support.processes import Router, start_worker, stop_all, wait_until

pytestmark = pytest.mark.timeout(180)

REQUESTS = 8
QUEUE = 2
FLAGS = ("--queue-start-within-s", "0", "--queue-max-requests", str(QUEUE))
PATIENT = ("--offer-timeout-s", "60", "--progress-timeout-s", "60", "--worker-expiry-s", "60")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Router, Any, Path]]:
    home = tmp_path_factory.mktemp("router-queue")
    model = make_tiny_model("llama", home / "tiny-llama")
    router = Router(home, model, *FLAGS, *PATIENT)
    worker = start_worker(home, "w1", router.workers_url, model)
    try:
        wait_until(lambda: "w1" in router.live_workers(), 60, "w1 live at the router")
        yield router, worker, model
    finally:
        worker.signal(signal.SIGCONT)
        stop_all([worker, router.child])


async def one(client: openai.AsyncOpenAI, model: str, i: int) -> dict[str, Any]:
    """One completion; its status, and the Retry-After and error body of a refusal."""
    try:
        r = await client.completions.create(
            model=model, prompt=f"request {i} " * 20, max_tokens=8, temperature=0, user=f"user{i % 3}"
        )
    except openai.RateLimitError as exc:
        return {"status": exc.status_code, "retry_after": exc.response.headers.get("retry-after"), "body": exc.body}
    return {"status": 200, "tokens": r.usage.completion_tokens if r.usage else 0}


def test_a_full_router_queue_answers_429_with_retry_after_and_loses_no_request(
    cluster: tuple[Router, Any, Path],
) -> None:
    router, worker, model = cluster

    def counters() -> dict[str, int]:
        return router.cluster()["router_counters"]

    async def scenario() -> list[dict[str, Any]]:
        client = openai.AsyncOpenAI(base_url=router.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        async with client:
            worker.signal(signal.SIGSTOP)
            first = asyncio.create_task(one(client, model.name, 0))
            await asyncio.to_thread(wait_until, lambda: counters().get("offers", 0) >= 1, 30, "the first offer")
            rest = [asyncio.create_task(one(client, model.name, i)) for i in range(1, REQUESTS)]
            refused = REQUESTS - 1 - QUEUE
            await asyncio.to_thread(
                wait_until,
                lambda: counters().get("queue_refused", 0) >= refused and counters().get("queued", 0) >= QUEUE,
                30,
                f"{QUEUE} requests waiting and {refused} refused",
            )
            worker.signal(signal.SIGCONT)
            return list(await asyncio.gather(first, *rest))

    answers = asyncio.run(scenario())
    assert len(answers) == REQUESTS
    done = [a for a in answers if a["status"] == 200]
    refusals = [a for a in answers if a["status"] == 429]
    assert len(done) == 1 + QUEUE and all(a["tokens"] == 8 for a in done), answers
    assert len(refusals) == REQUESTS - 1 - QUEUE, answers
    for a in refusals:
        assert a["retry_after"] is not None and int(a["retry_after"]) >= 1, a
        assert a["body"]["type"] == "rate_limit_error" and a["body"]["code"] == "queue_full", a
        assert f"{QUEUE} requests are waiting" in a["body"]["message"], a
    final = counters()
    assert final["queue_refused"] == len(refusals) and final.get("finished_length", 0) >= len(done)
