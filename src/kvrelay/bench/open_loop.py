"""Open-loop load through the OpenAI API (the official ``openai`` client): requests sent on a schedule, not on
answers, each one's fate recorded at the client.

``open_loop(base_url, model, prompts, at_s, max_tokens)`` sends streaming
completion ``i`` at ``at_s[i]`` seconds after the start, whatever the earlier
ones are doing, and returns one ``Answer`` per prompt once every one has ended:
the first token's time (of the first chunk with text, or of the last chunk
when no token had text), or the HTTP status of a refusal with its
``Retry-After`` header and OpenAI error body, or the error text of anything
else. ``closed_loop_rate`` measures what the server sustains: completions per
second with ``concurrency`` requests always in flight. Times are
``time.monotonic()``. Errors are kept, never raised.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Answer:
    sent: float = 0.0
    first_token: float | None = None
    finish_reason: str | None = None
    status: int | None = None
    """200 for a stream that ended normally; the HTTP status of a refusal."""
    retry_after: str | None = None
    error_body: Any = None
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent


async def _one(client: Any, model: str, prompt: Sequence[int], max_tokens: int, answer: Answer) -> None:
    import openai

    answer.sent = time.monotonic()
    try:
        stream = await client.completions.create(
            model=model, prompt=list(prompt), max_tokens=max_tokens, temperature=0, stream=True
        )
        async for chunk in stream:
            for choice in chunk.choices:
                if choice.text and answer.first_token is None:
                    answer.first_token = time.monotonic()
                if choice.finish_reason:
                    answer.finish_reason = choice.finish_reason
                    if answer.first_token is None:  # no token had text: the end is the first output
                        answer.first_token = time.monotonic()
        answer.status = 200
    except openai.APIStatusError as exc:
        answer.status, answer.error_body = exc.status_code, exc.body
        answer.retry_after = exc.response.headers.get("retry-after")
    except Exception as exc:  # noqa: BLE001 - a failed request is a measured outcome
        answer.error = f"{type(exc).__name__}: {exc}"


async def _open_loop(
    base_url: str,
    model: str,
    prompts: Sequence[Sequence[int]],
    at_s: Sequence[float],
    max_tokens: int,
    timeout_s: float,
) -> list[Answer]:
    from openai import AsyncOpenAI

    answers = [Answer() for _ in prompts]
    async with AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=timeout_s) as client:
        start = time.monotonic()
        tasks = []
        for prompt, at, answer in zip(prompts, at_s, answers, strict=True):
            delay = start + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(client, model, prompt, max_tokens, answer)))
        await asyncio.gather(*tasks)
    return answers


def open_loop(
    base_url: str,
    model: str,
    prompts: Sequence[Sequence[int]],
    at_s: Sequence[float],
    max_tokens: int,
    timeout_s: float = 600.0,
) -> list[Answer]:
    """Send prompt ``i`` at ``at_s[i]`` s (see the module contract); blocks until every answer has ended."""
    return asyncio.run(_open_loop(base_url, model, prompts, at_s, max_tokens, timeout_s))


def closed_loop_rate(
    base_url: str, model: str, prompts: Sequence[Sequence[int]], concurrency: int, max_tokens: int
) -> float:
    """Completions per second with ``concurrency`` in flight over ``prompts`` (each sent once; a refused one
    counts for nothing); RuntimeError when none completed."""

    async def run() -> float:
        from openai import AsyncOpenAI

        gate = asyncio.Semaphore(concurrency)
        answers = [Answer() for _ in prompts]
        async with AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=600) as client:

            async def guarded(prompt: Sequence[int], answer: Answer) -> None:
                async with gate:
                    await _one(client, model, prompt, max_tokens, answer)

            start = time.monotonic()
            await asyncio.gather(*(guarded(p, a) for p, a in zip(prompts, answers, strict=True)))
            elapsed = time.monotonic() - start
        done = sum(a.status == 200 for a in answers)
        if not done:
            raise RuntimeError(f"no request of the capacity run completed, e.g. {answers[0]}")
        return done / elapsed

    return asyncio.run(run())
