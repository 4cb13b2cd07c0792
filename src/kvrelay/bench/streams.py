"""Streaming completions through the OpenAI API, timed at the client.

``run_streams`` sends one streaming completion per prompt (token ids), at most
``concurrency`` at a time, through ``client`` (``StreamClient``: the official
``openai`` client by default, or the light one of ``bench.light_streams``), and
returns one ``StreamRecord`` per prompt in prompt order. Times are
``time.monotonic()``: ``sent`` before the request, ``token_times`` at every
chunk that carries text. A prompt whose index is in
``cancel_after`` is cancelled by the client (its connection closed) once it
has received that many text chunks. A stream that waits ``timeout_s`` (default
300) for its next bytes fails. Errors are kept in the record, never raised.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any


@dataclass(slots=True)
class StreamRecord:
    index: int
    prompt_tokens: int
    sent: float = 0.0
    token_times: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    cancelled: bool = False
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.sent if self.token_times else None

    @property
    def inter_token_s(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    def read(self, chunk: Any, now: float) -> None:
        """Fold one streamed chunk into the record, its text timed at ``now``: the official client's chunk or the
        light client's, both with ``usage`` and ``choices`` of ``text`` and ``finish_reason``."""
        if chunk.usage is not None:
            self.completion_tokens = chunk.usage.completion_tokens
            details = chunk.usage.prompt_tokens_details
            self.cached_tokens = details.cached_tokens if details is not None else None
        for choice in chunk.choices:
            if choice.text:
                self.token_times.append(now)
                self.text += choice.text
            if choice.finish_reason:
                self.finish_reason = choice.finish_reason

    @property
    def completed(self) -> bool:
        """The stream ended normally (a budget or a stop), without error or cancellation."""
        return self.error is None and not self.cancelled and self.finish_reason in ("length", "stop")


class StreamClient(enum.Enum):
    """Which client reads the streams."""

    OPENAI = "openai"
    LIGHT = "light"
    """``aiohttp`` and ``msgspec`` (``bench.light_streams``): about a fifth of the official client's CPU a token."""


Prompt = Sequence[int] | str
"""Token ids, or text the server tokenizes (for a router that routes by text)."""

Send = Callable[[Prompt, int, StreamRecord, int | None], Awaitable[None]]
"""One stream: ``send(prompt, max_tokens, record, cancel_at)`` fills ``record``, never raises."""


def prompt_field(prompt: Prompt) -> list[int] | str:
    """The completion request's ``prompt``."""
    return prompt if isinstance(prompt, str) else list(prompt)


async def _one(
    client: object, model: str, prompt: Prompt, max_tokens: int, record: StreamRecord, cancel_at: int | None
) -> None:
    record.sent = time.monotonic()
    try:
        stream = await client.completions.create(  # type: ignore[attr-defined]
            model=model,
            prompt=prompt_field(prompt),
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        try:
            async for chunk in stream:
                record.read(chunk, time.monotonic())
                if cancel_at is not None and len(record.token_times) >= cancel_at:
                    record.cancelled = True
                    break
        finally:
            await stream.close()
    except Exception as exc:  # noqa: BLE001 - a failed request is a measured outcome
        record.error = f"{type(exc).__name__}: {exc}"


async def _run(
    base_url: str,
    model: str,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    concurrency: int,
    cancel_after: dict[int, int],
    on_done: Callable[[StreamRecord], None],
    records: list[StreamRecord],
    timeout_s: float,
    client: StreamClient,
) -> list[StreamRecord]:
    gate = asyncio.Semaphore(max(1, concurrency))
    async with _session(client, base_url, model, timeout_s) as send:

        async def guarded(i: int) -> None:
            async with gate:
                await send(prompts[i], max_tokens, records[i], cancel_after.get(i))
            on_done(records[i])

        await asyncio.gather(*(guarded(i) for i in range(len(prompts))))
    return records


@asynccontextmanager
async def _session(client: StreamClient, base_url: str, model: str, timeout_s: float) -> AsyncIterator[Send]:
    if client is StreamClient.LIGHT:
        from kvrelay.bench.light_streams import light_session

        async with light_session(base_url, model, timeout_s) as send:
            yield send
        return
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=timeout_s) as openai:
        yield partial(_one, openai, model)


def run_streams(
    base_url: str,
    model: str,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    concurrency: int,
    cancel_after: dict[int, int] | None = None,
    on_done: Callable[[StreamRecord], None] = lambda r: None,
    records: list[StreamRecord] | None = None,
    timeout_s: float = 300.0,
    client: StreamClient = StreamClient.OPENAI,
) -> list[StreamRecord]:
    """Run the streams (see the module contract) on a private event loop; blocks until all have ended.

    ``records`` (one per prompt, from ``new_records``) lets another thread watch the streams as they run.
    """
    records = new_records(prompts) if records is None else records
    return asyncio.run(
        _run(base_url, model, prompts, max_tokens, concurrency, cancel_after or {}, on_done, records, timeout_s, client)
    )


def new_records(prompts: Sequence[Sequence[int]]) -> list[StreamRecord]:
    return [StreamRecord(i, len(p)) for i, p in enumerate(prompts)]
