"""Streams cut by a worker's ``kill -9``, compared with the same streams undisturbed.

``StreamSpec`` is one streaming completion (token-id prompt, budget, temperature and
seed; temperature 0 is greedy). ``Stream(http_url, model, spec)`` consumes it on a
thread, keeping its text pieces and the arrival time of each. ``run_round(http_url,
model, specs, cut=None)`` runs the specs at once and returns their streams; with
``cut``, it calls ``cut.strike`` while they run (``Cut``: wait until a worker holds at
least ``min_streams`` of them, each with ``min_delivered`` tokens delivered and
``min_left`` still to come, then kill it; no strike when the streams end first).
``compare(undisturbed, disturbed, strike)`` says per stream whether the text is the
same and whether it is complete, and, for the streams that were cut, how long their
clients waited for the next token after the kill (the continuation's time to first
token as the client sees it).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass(frozen=True, slots=True)
class StreamSpec:
    prompt: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None

    def body(self, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "prompt": list(self.prompt),
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.seed is not None:
            body["seed"] = self.seed
        return body


@dataclass
class Stream:
    """One streaming completion consumed on a thread (``done`` set at its end)."""

    http_url: str
    model: str
    spec: StreamSpec
    pieces: list[str] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    """``time.monotonic()`` at each text piece."""
    completion_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def start(self) -> Stream:
        threading.Thread(target=self._consume, name="failover-stream", daemon=True).start()
        return self

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def _consume(self) -> None:
        try:
            body = self.spec.body(self.model)
            with httpx.stream("POST", self.http_url + "/v1/completions", json=body, timeout=600) as response:
                if response.status_code != 200:
                    self.error = f"HTTP {response.status_code}: {response.read()!r}"
                    return
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: ") :])
                    if "error" in chunk:
                        self.error = str(chunk["error"])
                    if chunk.get("usage"):
                        self.completion_tokens = chunk["usage"]["completion_tokens"]
                    for choice in chunk.get("choices", ()):
                        if choice.get("text"):
                            self.pieces.append(choice["text"])
                            self.times.append(time.monotonic())
                        if choice.get("finish_reason"):
                            self.finish_reason = choice["finish_reason"]
        except (httpx.HTTPError, ValueError) as exc:
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.done.set()


@dataclass(frozen=True, slots=True)
class Cut:
    """Kill a worker mid-stream: ``requests()`` is the router's in-flight requests (``/cluster``'s
    ``requests``: each with ``worker_id`` and ``delivered``), ``kill(worker_id)`` kills it; ``victims`` (None:
    any) the workers it may kill."""

    requests: Callable[[], dict[str, Any]]
    kill: Callable[[str], None]
    min_delivered: int = 8
    min_left: int = 16
    min_streams: int = 2
    timeout_s: float = 120.0
    victims: frozenset[str] | None = None

    def strike(self, max_tokens: int, ended: Callable[[], bool]) -> Strike | None:
        """Wait for a worker holding enough streams mid-way and kill it; None when the streams ``ended()`` first."""
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline and not ended():
            requests = list(self.requests().values())
            mid: dict[str, int] = {}
            for state in requests:
                wid = state.get("worker_id")
                if not wid or (self.victims is not None and wid not in self.victims):
                    continue
                if self.min_delivered <= state.get("delivered", 0) <= max_tokens - self.min_left:
                    mid[wid] = mid.get(wid, 0) + 1
            if mid and max(mid.values()) >= self.min_streams:
                victim = max(sorted(mid), key=mid.__getitem__)
                self.kill(victim)
                held = sum(state.get("worker_id") == victim and state.get("delivered", 0) > 0 for state in requests)
                return Strike(victim, time.monotonic(), held)
            threading.Event().wait(0.02)
        if not ended():
            raise TimeoutError(f"no worker held {self.min_streams} streams mid-way within {self.timeout_s} s")
        return None


@dataclass(frozen=True, slots=True)
class Strike:
    """The killed worker, when (``time.monotonic()``), and how many of the round's streams it held."""

    victim: str
    at: float
    held: int


def run_round(
    http_url: str, model: str, specs: list[StreamSpec], cut: Cut | None = None, timeout_s: float = 600.0
) -> tuple[list[Stream], Strike | None]:
    """Run ``specs`` at once (and ``cut`` while they run); their streams and the strike (None: no cut, or the
    streams ended before a worker held enough of them mid-way)."""
    streams = [Stream(http_url, model, spec).start() for spec in specs]
    ended = lambda: all(stream.done.is_set() for stream in streams)  # noqa: E731
    strike = None if cut is None else cut.strike(max(spec.max_tokens for spec in specs), ended)
    deadline = time.monotonic() + timeout_s
    for stream in streams:
        if not stream.done.wait(max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"a stream did not end within {timeout_s} s")
    return streams, strike


@dataclass(frozen=True, slots=True)
class Comparison:
    """Per stream: ``same`` text as undisturbed, the full count delivered without error (``complete``), and
    ``resumed_s``: for a stream the kill cut, seconds from the kill to its next token (else None)."""

    same: tuple[bool, ...]
    complete: tuple[bool, ...]
    resumed_s: tuple[float | None, ...]

    @property
    def cut_waits(self) -> list[float]:
        return [w for w in self.resumed_s if w is not None]

    @property
    def cut_same(self) -> int:
        return sum(same for same, w in zip(self.same, self.resumed_s, strict=True) if w is not None)


def compare(undisturbed: list[Stream], disturbed: list[Stream], strike: Strike) -> Comparison:
    """The streams the kill cut are the ``strike.held`` ones that waited longest for a token after it."""
    waits: dict[int, float] = {}
    for i, stream in enumerate(disturbed):
        after = [t for t in stream.times if t > strike.at]
        if after and any(t <= strike.at for t in stream.times):
            waits[i] = after[0] - strike.at
    cut = set(sorted(waits, key=waits.__getitem__, reverse=True)[: strike.held])
    return Comparison(
        same=tuple(a.text == b.text for a, b in zip(undisturbed, disturbed, strict=True)),
        complete=tuple(s.completion_tokens == s.spec.max_tokens and s.error is None for s in disturbed),
        resumed_s=tuple(waits[i] if i in cut else None for i in range(len(disturbed))),
    )
