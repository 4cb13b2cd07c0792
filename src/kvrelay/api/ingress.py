"""The ingress: tokenization, chat templating and the bridge from HTTP requests to the router.

It never depends on the model runtime: it submits protocol requests to a
``ClusterRouter`` and turns the consumer's token deltas into text. Contract of
``Ingress.generate``: it yields ``TextDelta``s then exactly one ``Final``; if
the caller stops iterating early (a client disconnected) the request is
cancelled through the router, which cancels it at the worker.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from kvrelay.api.detokenize import IncrementalText
from kvrelay.api.errors import APIError, from_failure, invalid
from kvrelay.api.metrics import IngressSeries, Metrics
from kvrelay.api.schema import ChatRequest, CompletionRequest, SamplingFields
from kvrelay.api.templates import render_chat
from kvrelay.core.router.events import Outcome, Request
from kvrelay.protocol.messages import Sampling
from kvrelay.router.cluster_router import ClusterRouter, Consumer


@dataclass(frozen=True, slots=True)
class ServedModel:
    name: str
    tokenizer: Any
    architecture: str
    context_limit: int
    eos_token_ids: tuple[int, ...] = ()
    vocab_size: int = field(init=False)
    """``len(tokenizer)``, taken once: it costs about half a millisecond per call on Gemma 3's tokenizer."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "vocab_size", len(self.tokenizer))


@dataclass(frozen=True, slots=True)
class Prepared:
    """A validated request: prompt ids, budget, sampling and stop strings."""

    model: ServedModel
    prompt: list[int]
    max_tokens: int
    sampling: Sampling
    stop_strings: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str
    tokens: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Final:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft_s: float | None


class Ingress:
    def __init__(
        self, router: ClusterRouter, models: dict[str, ServedModel], metrics: Metrics, serving: Callable[[str], bool]
    ) -> None:
        self.router = router
        self.models = models
        self.metrics = metrics
        self.serving = serving
        """Whether at least one live worker serves a model now."""
        self.series = IngressSeries.register(metrics.registry)

    def model(self, name: str) -> ServedModel:
        served = self.models.get(name)
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
        model = self.model(body.model)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = [t for t in prompt if isinstance(t, int)]
            bad = [t for t in ids if not 0 <= t < model.vocab_size]
            if bad:
                raise invalid(f"prompt token ids {bad[:5]} are outside the vocabulary of {model.vocab_size}", "prompt")
        elif isinstance(prompt, list):
            if len(prompt) != 1:
                raise invalid("only one prompt per request is supported (n = 1)", "prompt")
            ids = list(model.tokenizer.encode(prompt[0]))
        else:
            ids = list(model.tokenizer.encode(prompt))
        return self._prepare(body, model, ids, default_max=16)

    def prepare_chat(self, body: ChatRequest) -> Prepared:
        model = self.model(body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        ids = render_chat(model.tokenizer, model.architecture, messages)
        return self._prepare(body, model, ids, default_max=None)

    def _prepare(self, body: SamplingFields, model: ServedModel, ids: list[int], default_max: int | None) -> Prepared:
        if body.n != 1:
            raise invalid(f"n = {body.n} is not supported; kvrelay returns one choice (n = 1)", "n")
        if not ids:
            raise invalid("the prompt is empty", "prompt")
        room = model.context_limit - len(ids)
        if room < 1:
            raise APIError(
                413,
                f"the prompt has {len(ids)} tokens; the context limit of '{model.name}' is {model.context_limit}",
                "invalid_request_error",
                "prompt",
                "context_length_exceeded",
            )
        asked = body.max_completion_tokens or body.max_tokens
        max_tokens = asked if asked is not None else (default_max or min(room, 1024))
        if len(ids) + max_tokens > model.context_limit:
            raise APIError(
                413,
                f"{len(ids)} prompt tokens + max_tokens {max_tokens} exceed the context limit "
                f"{model.context_limit} of '{model.name}'",
                "invalid_request_error",
                "max_tokens",
                "context_length_exceeded",
            )
        stops = body.stop if isinstance(body.stop, list) else ([body.stop] if body.stop else [])
        stop_ids = tuple(s for s in stops if isinstance(s, int))
        bad = [t for t in stop_ids if not 0 <= t < model.vocab_size]
        if bad:
            raise invalid(f"stop token ids {bad[:5]} are outside the vocabulary of {model.vocab_size}", "stop")
        stop_ids += model.eos_token_ids
        stop_strings = tuple(s for s in stops if isinstance(s, str) and s)
        # Draws use the seed modulo 2**64 (models.sampling); reducing it here keeps every seed encodable on the wire.
        seed = body.seed % 2**64 if body.seed is not None else int.from_bytes(uuid.uuid4().bytes[:7], "little")
        sampling = Sampling(temperature=body.temperature, top_p=body.top_p, seed=seed, stop_token_ids=stop_ids)
        return Prepared(model, ids, max_tokens, sampling, stop_strings)

    async def generate(self, p: Prepared) -> AsyncIterator[TextDelta | Final]:
        if not self.serving(p.model.name):
            raise APIError(
                503, f"no worker serves model '{p.model.name}' right now", "service_unavailable", "model", "no_worker"
            )
        rid = "kv-" + hashlib.blake2b(uuid.uuid4().bytes, digest_size=10).hexdigest()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        started = time.monotonic()
        self.router.submit(
            Request(rid, p.model.name, tuple(p.prompt), p.max_tokens, p.sampling),
            Consumer(
                lambda index, tokens: queue.put_nowait(("delta", tokens)),
                lambda outcome: queue.put_nowait(("done", outcome)),
            ),
        )
        self.series.requests.labels(model=p.model.name).inc()
        detok = IncrementalText(p.model.tokenizer)
        emitted = ""
        held = ""
        finished = False
        first_token_at: float | None = None
        last_token_at: float | None = None
        try:
            while True:
                kind, payload = await queue.get()
                if kind == "delta":
                    now = time.monotonic()
                    if first_token_at is None:
                        first_token_at = now
                        self.series.ttft.observe(now - started)
                    elif last_token_at is not None:
                        self.series.inter_token.observe(now - last_token_at)
                    last_token_at = now
                    held += detok.push(payload)
                    text, stop_hit, held = _cut_at_stop(emitted, held, p.stop_strings)
                    if text:
                        emitted += text
                        yield TextDelta(text, tuple(payload))
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
                text, hit, rest = _cut_at_stop(emitted, held, p.stop_strings)
                text += "" if hit else rest
                if text:
                    emitted += text
                    yield TextDelta(text, ())
                cached = sum(outcome.usage.cached_tokens.values())
                for tier, n in outcome.usage.cached_tokens.items():
                    self.series.cached_tokens.labels(tier=tier).inc(n)
                self.series.recomputed_tokens.inc(outcome.usage.recomputed_tokens)
                reason = (
                    "stop"
                    if outcome.finish_reason == "stop"
                    else ("length" if outcome.finish_reason == "length" else outcome.finish_reason)
                )
                yield Final(reason, len(p.prompt), len(outcome.tokens), cached, _since(started, first_token_at))
                return
        finally:
            if not finished:
                self.router.cancel(rid)
                self.series.disconnects.inc()


def _since(started: float, at: float | None) -> float | None:
    return None if at is None else at - started


def _cut_at_stop(emitted: str, held: str, stops: tuple[str, ...]) -> tuple[str, bool, str]:
    """Split ``held`` into (text safe to emit, whether a stop string was hit, text still held back)."""
    if not stops:
        return held, False, ""
    window = emitted[-max(len(s) for s in stops) :] + held
    offset = len(window) - len(held)
    for stop in stops:
        at = window.find(stop)
        if at != -1:
            return held[: max(0, at - offset)], True, ""
    keep = max(len(s) for s in stops) - 1
    for n in range(min(keep, len(held)), 0, -1):
        if any(s.startswith(held[-n:]) for s in stops):
            return held[:-n], False, held[-n:]
    return held, False, ""
