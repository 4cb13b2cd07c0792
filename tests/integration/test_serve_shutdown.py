"""``kvrelay serve`` on SIGTERM, as a user runs it: the drain is bounded, streams still running at the bound
end with an error event in OpenAI's format that says why, every finished request's outcome is in the SQLite
file, and the process exits 0."""

from __future__ import annotations

import contextlib
import signal
import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvrelay.testing.ports import free_port
from kvrelay.testing.tiny_models import make_tiny_model
from tests.support.processes import OpenAIStream, StreamingRequest, child_env, kvrelay, wait_until

pytestmark = pytest.mark.timeout(240)

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12] * 4
SHORT = 8
LONG = 4000
"""Far more tokens than the tiny model decodes within the drain bound."""
DRAIN_S = 10.0


def up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def outcomes(db: Path) -> list[tuple[Any, ...]]:
    with contextlib.closing(sqlite3.connect(db)) as con:
        return con.execute("select finish_reason, generated_tokens, error from outcomes order by time").fetchall()


def test_sigterm_drains_within_its_bound_ends_the_rest_with_an_error_event_writes_every_outcome_and_exits_0(
    tmp_path: Path,
) -> None:
    model = make_tiny_model(
        "llama",
        tmp_path / "slowllama",
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=6,
        max_position_embeddings=4096,
        eos_token_id=None,
    )
    port, db = free_port(), tmp_path / "facts.sqlite3"
    args = ["--port", str(port), "--model", str(model), "--dtype", "float32", "--kv-tokens", "16384"]
    args += ["--lanes", "8", "--db", f"sqlite:///{db}", "--drain-s", str(DRAIN_S)]
    server = kvrelay("serve", "serve", args, child_env(tmp_path))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: up(url), 120, "kvrelay serve answering /health")
        short = [StreamingRequest(url, model.name, PROMPT, SHORT) for _ in range(3)]
        long = OpenAIStream(url, model.name, PROMPT, LONG)
        assert long.first.wait(60) and all(s.first.wait(60) for s in short)
        stopped_at = time.monotonic()
        server.signal(signal.SIGTERM)
        assert server.process.wait(DRAIN_S + 30) == 0, server.tail()
        assert time.monotonic() - stopped_at < DRAIN_S + 20
        for request in short:  # finished within the drain, each with its full count
            request.result(10)
            assert request.finish_reason == "length" and request.usage["completion_tokens"] == SHORT  # type: ignore[index]
        assert long.done.wait(10)
        assert isinstance(long.error, openai.APIError), long.error  # the client read an error event, not a cut stream
        message = str(long.error.message)
        assert "shut down before the request finished" in message and f"of {LONG} tokens were delivered" in message
        assert long.error.body is not None and long.error.body.get("code") == "shutting_down"  # type: ignore[union-attr]
        rows = outcomes(db)
        assert sorted(r[0] for r in rows) == ["error", "length", "length", "length"]  # one outcome per request
        (failed,) = [r for r in rows if r[0] == "error"]
        assert 0 < failed[1] < LONG and "shut down before the request finished" in failed[2]
        assert "kvrelay serve stopped" in "\n".join(server.lines)
    finally:
        server.stop()
