"""The figures ``bench/engines.py`` takes of one OpenAI-compatible server, through the same streaming client
for both servers (``kvrelay.bench.streams`` with its ``StreamClient``: the light one or the official ``openai``
client; token-id prompts, greedy).

- ``decode``: ``streams`` completions sent at once, each a fresh prompt; the aggregate decode rate is counted
  in the window where every stream is decoding (from the moment the last stream got its first token to the
  moment the first stream that ran to its token budget ended), so no prefill and no ramp-down is in it: the
  tokens that arrived in that window over its length. A stream that stops early (an end-of-sequence token)
  leaves the batch as it would in service and does not close the window (both servers run the same model
  greedily on the same prompts). A chunk carries the text of one token, or of a few when a character spans
  them; a stream's chunks count as its ``completion_tokens / chunks`` tokens each.
- ``ttft``: one completion alone; the seconds from sending it to its first text, and the prompt tokens the
  server reports it served from cache (``usage.prompt_tokens_details.cached_tokens``).

``prompts(count, length, vocab, seed)`` are deterministic random token ids (ordinary ids, not the special
ones at the start of a large vocabulary); the same seed gives both servers the same work.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvrelay.bench.streams import StreamClient, StreamRecord, run_streams

STREAM_TIMEOUT_S = 3600.0
"""How long a stream may wait for its next bytes: a slow server is measured, not failed (vLLM's bfloat16 path on
a CPU without AVX-512 takes minutes for a 32-stream prefill on a busy 2-core machine)."""


class MeasureError(RuntimeError):
    """A stream failed or ended without text: the figure cannot be taken."""


@dataclass(frozen=True, slots=True)
class Decode:
    streams: int
    tokens_per_s: float
    window_s: float
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class Ttft:
    seconds: float
    prompt_tokens: int
    cached_tokens: int


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``count`` prompts of ``length`` random token ids (ids ``1000 .. 200,000`` of a large vocabulary, ``4 ..``
    of a small one)."""
    rng = random.Random(seed)
    low, high = (1000, min(vocab, 200_000)) if vocab > 2000 else (4, vocab)
    return [[rng.randrange(low, high) for _ in range(length)] for _ in range(count)]


def decode(url: str, model: str, batch: list[list[int]], max_tokens: int, client: StreamClient) -> Decode:
    """The aggregate decode rate of ``batch`` streamed at once (see the module docstring)."""
    records = _streams(url, model, batch, max_tokens, client)
    _check(url, records)
    return Decode(len(batch), decode_rate(records), decode_window(records), sum(_tokens(r) for r in records))


def decode_window(records: list[StreamRecord]) -> float:
    """Seconds in which every stream was decoding (see the module docstring)."""
    start, end = _window(records)
    return max(0.0, end - start)


def _window(records: list[StreamRecord]) -> tuple[float, float]:
    """From the last first token to the first last token of a stream that ran to its budget (of any stream when
    none did)."""
    full = [r for r in records if r.finish_reason == "length"] or records
    return max(r.token_times[0] for r in records), min(r.token_times[-1] for r in full)


def decode_rate(records: list[StreamRecord]) -> float:
    """Tokens per second that arrived inside ``decode_window`` (see the module docstring); 0 for no window."""
    start, end = _window(records)
    if end <= start:
        return 0.0
    tokens = 0.0
    for r in records:
        inside = sum(1 for t in r.token_times if start < t <= end)
        tokens += inside * _tokens(r) / len(r.token_times)
    return tokens / (end - start)


def ttft(url: str, model: str, prompt: list[int], client: StreamClient, max_tokens: int = 4) -> Ttft:
    """The first text's delay of ``prompt`` sent alone, and its cached prompt tokens."""
    (record,) = _streams(url, model, [prompt], max_tokens, client)
    _check(url, [record])
    assert record.ttft_s is not None
    return Ttft(record.ttft_s, len(prompt), record.cached_tokens or 0)


def _streams(url: str, model: str, batch: list[list[int]], max_tokens: int, client: StreamClient) -> list[StreamRecord]:
    return run_streams(url, model, batch, max_tokens, len(batch), timeout_s=STREAM_TIMEOUT_S, client=client)


def _tokens(record: StreamRecord) -> int:
    return record.completion_tokens if record.completion_tokens is not None else len(record.token_times)


def _check(url: str, records: list[StreamRecord]) -> None:
    for r in records:
        if r.error is not None or not r.token_times:
            raise MeasureError(f"{url}: stream {r.index} failed: {r.error or 'no text came back'}")
