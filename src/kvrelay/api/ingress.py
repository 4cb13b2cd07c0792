"""The ingress: request bodies to prepared requests, and the bridge from HTTP requests to the router.

It never depends on the model runtime: it submits protocol requests to a
``ClusterRouter`` and turns the consumer's token deltas into text. Contract:
- ``Ingress.completion(raw)`` / ``Ingress.chat(raw)`` decode a body
  (``api.body``), render the chat (``api.templates``), tokenize and validate it:
  a body of at most ``INLINE_PREPARE_BYTES`` on the event loop itself, a larger
  one on a pool of ``PREPARE_THREADS`` threads, so a huge prompt never stalls the
  loop; invalid input raises ``APIError`` naming the field.
- ``Ingress.body_limit()`` is the byte bound of a request body (``api.body``).
- ``Ingress.generate`` yields ``TextDelta``s then exactly one ``Final``, or
  raises ``APIError`` when the request failed (after the text of the tokens it
  got, if any). Every batch of tokens yields one, with empty text while its text is held back (an
  incomplete character, the start of a possible stop string), as vLLM's OpenAI server streams them
  (``serving_completion``: a chunk per step that produced tokens), so a stream shows its first token when
  it comes, not when it first makes a character; token deltas that arrived while the caller was busy with the
  previous one come as one ``TextDelta``, so a loaded router writes fewer,
  larger chunks instead of falling behind; if the caller stops iterating early (a client disconnected) the
  request is cancelled through the router, which cancels it at the worker. The
  router knows the request by ``rid`` (``new_request_id()``: ``kv-`` and 20 hex
  digits), which the HTTP response's ``id`` carries, so a client's id names the
  request in the fact store (``kvrelay explain``).
- A request for a model no worker has announced is a 404 naming the served models, unless the model is
  ``awaited`` (the router loaded it and its workers have not registered yet, as after a router restart):
  then a 503 with ``Retry-After``.
- ``generate(p, rid, traceparent)`` continues the client's W3C trace context when it parses
  (``protocol.trace_context``; else it is ignored): with tracing on (``tracing``), an ``ingress`` span of
  the request's whole life is a child of it and the router's and workers' spans are the span's children;
  with tracing off, the client's context is passed on as it came.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from kvrelay.api.body import body_limit, decode_body
from kvrelay.api.detokenize import IncrementalText
from kvrelay.api.errors import APIError, from_failure, invalid
from kvrelay.api.metrics import IngressSeries, Metrics
from kvrelay.api.openapi import describe
from kvrelay.api.responses import FinishReason
from kvrelay.api.schema import ChatRequest, CompletionRequest, SamplingFields
from kvrelay.api.served_model import ServedModel, encode_prompt, over_context
from kvrelay.api.stop_strings import cut_at_stop
from kvrelay.api.templates import TemplateRejected, canonical_turns, render_chat
from kvrelay.core.router.events import Outcome, Request
from kvrelay.protocol.messages import Sampling
from kvrelay.protocol.trace_context import parse_traceparent
from kvrelay.router.cluster_router import ClusterRouter, Consumer

if TYPE_CHECKING:
    from kvrelay.telemetry.tracing import Tracing


@dataclass(frozen=True, slots=True)
class Prepared:
    """A validated request: prompt ids, budget, sampling and stop strings."""

    model: ServedModel
    prompt: list[int]
    max_tokens: int
    sampling: Sampling
    stop_strings: tuple[str, ...]
    priority: int = 0
    """The router queue's class (lower first)."""
    user: str = ""
    """Whose share of the router queue the request takes."""


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str
    tokens: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Final:
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft_s: float | None


T = TypeVar("T")

PREPARE_THREADS = 4
"""Threads that decode, template and tokenize request bodies, off the event loop."""
INLINE_PREPARE_BYTES = 8192
"""Bodies up to this size are prepared on the event loop (a prompt of about 2,000 tokens, under a millisecond):
the hop to a thread and back cost more CPU than that, and the threads' hold of the GIL slowed the loop
(docs/performance.md, "The router's CPU per request on vLLM engines")."""
AWAITED_RETRY_S = 2
"""Seconds a client is told to wait (``Retry-After``) when its model's workers have not registered yet."""


def new_request_id() -> str:
    """A fresh router request id: ``kv-`` and 20 random hex digits."""
    return "kv-" + hashlib.blake2b(uuid.uuid4().bytes, digest_size=10).hexdigest()


class Ingress:
    """Requests from HTTP bodies to the router (see the module contract)."""

    def __init__(
        self,
        router: ClusterRouter,
        models: dict[str, ServedModel],
        metrics: Metrics,
        serving: Callable[[str], bool],
        max_body_bytes: int | None = None,
        tracing: Tracing | None = None,
        awaited: Collection[str] = (),
    ) -> None:
        self.router = router
        self.tracing = tracing
        self.models = models
        self.metrics = metrics
        self.serving = serving
        """Whether at least one live worker serves a model now."""
        self.awaited = awaited
        """Models this router can tokenize that no worker has announced yet (after a start or restart)."""
        self.max_body_bytes = max_body_bytes
        """The bound on a request body's bytes; None: ``api.body.body_limit`` of the served models' contexts."""
        self.series = IngressSeries.register(metrics.registry)
        self._pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="kvrelay-prepare")

    def body_limit(self) -> int:
        if self.max_body_bytes is not None:
            return self.max_body_bytes
        return body_limit(model.context_limit for model in list(self.models.values()))

    async def completion(self, raw: bytes) -> tuple[CompletionRequest, Prepared]:
        """The completion request in ``raw``, decoded and prepared (module contract); ``APIError`` if invalid."""
        return await self._prepared(self._completion, raw)

    async def chat(self, raw: bytes) -> tuple[ChatRequest, Prepared]:
        """The chat request in ``raw``, decoded, templated and prepared (module contract); ``APIError`` if invalid."""
        return await self._prepared(self._chat, raw)

    async def _prepared(self, prepare: Callable[[bytes], T], raw: bytes) -> T:
        """``prepare(raw)`` on the loop for a body up to ``INLINE_PREPARE_BYTES``, else on a prepare thread."""
        if len(raw) <= INLINE_PREPARE_BYTES:
            return prepare(raw)
        return await asyncio.get_running_loop().run_in_executor(self._pool, prepare, raw)

    def close(self) -> None:
        """Stop the preparing threads; a preparation under way finishes on its own."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _completion(self, raw: bytes) -> tuple[CompletionRequest, Prepared]:
        body = decode_body(raw, CompletionRequest, partial(describe, CompletionRequest))
        return body, self.prepare_completion(body)

    def _chat(self, raw: bytes) -> tuple[ChatRequest, Prepared]:
        body = decode_body(raw, ChatRequest, partial(describe, ChatRequest))
        return body, self.prepare_chat(body)

    def model(self, name: str) -> ServedModel:
        served = self.models.get(name)
        if served is None and name in self.awaited:
            raise APIError(
                503,
                f"model '{name}' has no worker registered yet: workers register within seconds of a router start; "
                f"retry after {AWAITED_RETRY_S} s",
                "service_unavailable",
                "model",
                "no_worker",
                {"Retry-After": str(AWAITED_RETRY_S)},
            )
        if served is None:
            raise APIError(
                404,
                f"model '{name}' is not served; served models: {', '.join(sorted(self.models))}",
                "invalid_request_error",
                "model",
                "model_not_found",
            )
        return served

    def prepare_completion(self, body: CompletionRequest) -> Prepared:
        """Tokenize the prompt (text gets the tokenizer's special tokens) and validate the request."""
        model = self.model(body.model)
        prompt = body.prompt
        if isinstance(prompt, str):
            ids = encode_prompt(model, prompt, special=True, param="prompt")
        elif all(isinstance(t, int) for t in prompt):
            ids = [t for t in prompt if isinstance(t, int)]
            bad = [t for t in ids if t >= model.vocab_size]
            if bad:
                raise invalid(
                    f"prompt token ids {bad[:5]} are outside the vocabulary of '{model.name}' "
                    f"(ids 0 to {model.vocab_size - 1})",
                    "prompt",
                )
        elif any(isinstance(t, int) for t in prompt):
            raise invalid(
                "`prompt` mixes token ids and strings; send a string, an array of token ids, or an array of one string",
                "prompt",
            )
        elif len(prompt) != 1:
            raise invalid(
                f"`prompt` holds {len(prompt)} strings; kvrelay takes one prompt per request: send one string",
                "prompt",
            )
        elif not prompt[0]:
            raise invalid("the prompt is empty; send the text to continue", "prompt")
        else:
            ids = encode_prompt(model, str(prompt[0]), special=True, param="prompt")
        return self._prepare(body, model, ids, default_max=16, prompt_param="prompt")

    def prepare_chat(self, body: ChatRequest) -> Prepared:
        """Render the messages with the model's chat template (``api.templates``), tokenize, validate."""
        model = self.model(body.model)
        turns = canonical_turns((m.role, m.text()) for m in body.messages)
        try:
            text = render_chat(model.tokenizer, model.architecture, turns)
        except TemplateRejected as exc:
            raise invalid(f"the chat template of '{model.name}' rejects these messages: {exc}", "messages") from None
        ids = encode_prompt(model, text, special=False, param="messages")
        return self._prepare(body, model, ids, default_max=None, prompt_param="messages")

    def _prepare(
        self, body: SamplingFields, model: ServedModel, ids: list[int], default_max: int | None, prompt_param: str
    ) -> Prepared:
        if not ids:
            raise invalid("the prompt is empty; send the text to continue", prompt_param)
        room = model.context_limit - len(ids)
        if room < 1:
            raise over_context(model, prompt_param, f"{len(ids):,} tokens")
        asked = body.max_completion_tokens or body.max_tokens
        max_tokens = asked if asked is not None else (default_max or min(room, 1024))
        if len(ids) + max_tokens > model.context_limit:
            raise APIError(
                413,
                f"{len(ids)} prompt tokens + max_tokens {max_tokens} exceed the context limit "
                f"{model.context_limit} of '{model.name}'; ask for at most {room} tokens",
                "invalid_request_error",
                "max_completion_tokens" if body.max_completion_tokens else "max_tokens",
                "context_length_exceeded",
            )
        stops = body.stop if isinstance(body.stop, list) else ([body.stop] if body.stop else [])
        stop_ids = tuple(s for s in stops if isinstance(s, int))
        bad = [t for t in stop_ids if t >= model.vocab_size]
        if bad:
            raise invalid(
                f"stop token ids {bad[:5]} are outside the vocabulary of '{model.name}' "
                f"(ids 0 to {model.vocab_size - 1})",
                "stop",
            )
        stop_ids += model.eos_token_ids
        stop_strings = tuple(s for s in stops if isinstance(s, str) and s)
        # Draws use the seed modulo 2**64 (models.sampling); reducing it here keeps every seed encodable on the wire.
        seed = body.seed % 2**64 if body.seed is not None else int.from_bytes(uuid.uuid4().bytes[:7], "little")
        sampling = Sampling(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            seed=seed,
            stop_token_ids=stop_ids,
        )
        return Prepared(model, ids, max_tokens, sampling, stop_strings, body.priority or 0, body.user or "")

    async def generate(self, p: Prepared, rid: str, traceparent: str | None = None) -> AsyncIterator[TextDelta | Final]:
        if not self.serving(p.model.name):
            raise APIError(
                503, f"no worker serves model '{p.model.name}' right now", "service_unavailable", "model", "no_worker"
            )
        context = parse_traceparent(traceparent) or ""
        span = None
        if self.tracing is not None:
            from kvrelay.telemetry.ingress_span import start_ingress_span

            span, context = start_ingress_span(self.tracing, context, rid, p.model.name, len(p.prompt))
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        started = time.monotonic()
        self.router.submit(
            Request(
                rid,
                p.model.name,
                tuple(p.prompt),
                p.max_tokens,
                p.sampling,
                traceparent=context,
                priority=p.priority,
                user=p.user,
            ),
            Consumer(
                lambda index, tokens: queue.put_nowait(("delta", tokens)),
                lambda outcome: queue.put_nowait(("done", outcome)),
            ),
        )
        self.series.requests.labels(model=p.model.name).inc()
        detok = IncrementalText(p.model.decode)
        emitted = ""
        held = ""
        finished = False
        first_token_at: float | None = None
        last_token_at: float | None = None
        after: tuple[str, Any] | None = None
        try:
            while True:
                kind, payload = after or await queue.get()
                after = None
                if kind == "delta":
                    # deltas that queued while the response was being written are relayed as one
                    while not queue.empty() and after is None:
                        item = queue.get_nowait()
                        if item[0] == "delta":
                            payload = (*payload, *item[1])
                        else:
                            after = item
                    now = time.monotonic()
                    if first_token_at is None:
                        first_token_at = now
                        self.series.ttft.observe(now - started)
                    elif last_token_at is not None:
                        self.series.inter_token.observe(now - last_token_at)
                    last_token_at = now
                    held += detok.push(payload)
                    text, stop_hit, held = cut_at_stop(emitted, held, p.stop_strings)
                    emitted += text
                    yield TextDelta(text, tuple(payload))  # empty while the text is held back, as vLLM streams it
                    if stop_hit:
                        finished = True
                        self.router.cancel(rid)
                        yield Final("stop", len(p.prompt), len(detok.tokens), 0, _since(started, first_token_at))
                        return
                    continue
                outcome: Outcome = payload
                finished = True
                if outcome.failure is not None and not outcome.tokens:
                    self.series.errors.labels(reason=outcome.failure.kind).inc()
                    raise from_failure(outcome.failure, p.model.name)
                held += detok.flush()
                text, hit, rest = cut_at_stop(emitted, held, p.stop_strings)
                text += "" if hit else rest
                if text:
                    emitted += text
                    yield TextDelta(text, ())
                if outcome.failure is not None:  # after some tokens: the stream ends with an error saying why
                    self.series.errors.labels(reason=outcome.failure.kind).inc()
                    raise from_failure(outcome.failure, p.model.name)
                cached = sum(outcome.usage.cached_tokens.values())
                for tier, n in outcome.usage.cached_tokens.items():
                    self.series.cached_tokens.labels(tier=tier).inc(n)
                self.series.recomputed_tokens.inc(outcome.usage.recomputed_tokens)
                reason: FinishReason = (
                    "stop"
                    if outcome.finish_reason == "stop"
                    else "length"
                    if outcome.finish_reason == "length"
                    else "error"
                )
                yield Final(reason, len(p.prompt), len(outcome.tokens), cached, _since(started, first_token_at))
                return
        finally:
            if not finished:
                self.router.cancel(rid)
                self.series.disconnects.inc()
            if span is not None:
                span.set_attribute("kvrelay.completed", finished)
                span.end()


def _since(started: float, at: float | None) -> float | None:
    return None if at is None else at - started
