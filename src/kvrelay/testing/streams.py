"""Streaming completions as a client sees them, every event kept, for the invariant checker.

``stream_once(base_url, model, prompt, max_tokens)`` posts one greedy
streaming completion (token-id prompt, usage included) and returns a
``StreamRecord``: the HTTP status, each text piece, each ``finish_reason``,
each error (an HTTP error body, or an error event inside the stream), how
many ``[DONE]`` markers came and whether anything followed one, the usage,
and a transport failure (a refused or broken connection, a read timeout). It
never raises for what the server does; the checker judges the record.

``StreamLoad(netns, base_url, model)`` runs such requests concurrently, each
on a thread inside a lab host (``testing.netns``), so the client is a host of
the lab like any other.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvrelay.testing.netns import start_in_netns

READ_TIMEOUT_S = 240.0
"""The longest silence a client accepts (before the first token, or inside a stream); a stream silent longer ends
as a transport failure, which the checker counts as lost. Generous: a slow cluster is not a lossy one."""


@dataclass
class StreamRecord:
    """One request as its client saw it; ``ended_at`` stays None while it has not ended."""

    index: int
    prompt: list[int]
    max_tokens: int
    started_at: float = 0.0
    response_id: str | None = None
    status: int | None = None
    pieces: list[str] = field(default_factory=list)
    finishes: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    done_markers: int = 0
    events_after_done: int = 0
    usage: dict[str, Any] | None = None
    transport_error: str | None = None
    first_token_at: float | None = None
    ended_at: float | None = None
    started: threading.Event = field(default_factory=threading.Event, repr=False)
    """Set at the first token, or at the end when none came."""

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.started_at

    @property
    def request_id(self) -> str | None:
        """The router's request id (the response id without its ``cmpl-`` prefix)."""
        if self.response_id is None or not self.response_id.startswith("cmpl-"):
            return None
        return self.response_id[len("cmpl-") :]


def _error_message(body: Any) -> str:
    """The message of an OpenAI error body (``{"error": {"message": ...}}``), or '' when it has none."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        message = body["error"].get("message")
        return message if isinstance(message, str) else ""
    return ""


def _read_event(record: StreamRecord, payload: str) -> None:
    if record.done_markers:
        record.events_after_done += 1
    if payload == "[DONE]":
        record.done_markers += 1
        return
    event = json.loads(payload)
    if "error" in event:
        record.errors.append(_error_message(event) or f"an error event without a message: {payload[:200]}")
        return
    record.response_id = record.response_id or event.get("id")
    if event.get("usage"):
        record.usage = event["usage"]
    for choice in event.get("choices", ()):
        if choice.get("text"):
            if record.first_token_at is None:
                record.first_token_at = time.monotonic()
                record.started.set()
            record.pieces.append(choice["text"])
        if choice.get("finish_reason") is not None:
            record.finishes.append(choice["finish_reason"])


def stream_into(record: StreamRecord, base_url: str, model: str, read_timeout_s: float = READ_TIMEOUT_S) -> None:
    """Run ``record``'s request and fill ``record`` in (see the module docstring); never raises."""
    body = {
        "model": model,
        "prompt": record.prompt,
        "max_tokens": record.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    timeout = httpx.Timeout(10.0, read=read_timeout_s)
    record.started_at = time.monotonic()
    try:
        with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=timeout) as response:
            record.status = response.status_code
            if response.status_code != 200:
                response.read()
                try:
                    parsed = response.json()
                except ValueError:
                    parsed = None
                record.errors.append(_error_message(parsed) or f"HTTP {response.status_code}: {response.text[:200]}")
                return
            for line in response.iter_lines():
                if line.startswith("data: "):
                    _read_event(record, line[len("data: ") :])
    except (httpx.HTTPError, OSError, ValueError) as exc:
        record.transport_error = f"{type(exc).__name__}: {exc}"
    finally:
        record.ended_at = time.monotonic()
        record.started.set()


class StreamLoad:
    """Concurrent streaming requests from inside lab host ``netns`` (one thread each)."""

    def __init__(self, netns: str, base_url: str, model: str, read_timeout_s: float = READ_TIMEOUT_S) -> None:
        self.netns = netns
        self.base_url = base_url
        self.model = model
        self.read_timeout_s = read_timeout_s
        self.records: list[StreamRecord] = []
        self._threads: list[threading.Thread] = []

    def submit(self, prompt: list[int], max_tokens: int) -> StreamRecord:
        """Start one request; its record fills in as it streams."""
        record = StreamRecord(len(self.records), list(prompt), max_tokens)
        self.records.append(record)
        thread = start_in_netns(
            self.netns,
            lambda: stream_into(record, self.base_url, self.model, self.read_timeout_s),
            f"stream-{record.index}",
        )
        self._threads.append(thread)
        return record

    def wait_started(self, timeout_s: float) -> bool:
        """Whether every request has had its first token (or ended) within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        return all(r.started.wait(max(0.0, deadline - time.monotonic())) for r in list(self.records))

    def in_flight(self) -> int:
        return sum(1 for r in self.records if r.ended_at is None)

    def wait(self, timeout_s: float) -> list[StreamRecord]:
        """Every record, once all have ended or ``timeout_s`` passed (a record still open then is lost)."""
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return list(self.records)
