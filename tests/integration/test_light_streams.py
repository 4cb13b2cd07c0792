"""The benchmarks' light streaming client reads what the official ``openai`` client reads, from a real server.

An embedded kvrelay server of a tiny random Gemma 3: the same token-id prompts streamed by
``bench.streams``' light client and by the official one give the same text, finish reason,
completion and cached tokens; a cancelled stream stops after its chunks;
an unknown model is an error in the record, not an exception.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvrelay.bench.streams import StreamClient, run_streams
from kvrelay.testing.tiny_models import make_tiny_model
from tests.support.server_thread import ServerThread

PROMPTS = [[5 + i, 17, 29, 41, 53, 65, 77, 89] * 3 for i in range(4)]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    home = tmp_path_factory.mktemp("light-streams")
    model = make_tiny_model("gemma3", home / "gemma3")
    with ServerThread(model, f"sqlite:///{home / 'facts.sqlite3'}") as s:
        yield s


def test_the_light_client_reads_what_the_official_client_reads(server: ServerThread) -> None:
    model = served_name(server)
    official = run_streams(server.base_url, model, PROMPTS, MAX_TOKENS, concurrency=len(PROMPTS))
    light = run_streams(server.base_url, model, PROMPTS, MAX_TOKENS, len(PROMPTS), client=StreamClient.LIGHT)
    assert all(r.error is None and r.completed for r in official + light), [r.error for r in official + light]
    for a, b in zip(official, light, strict=True):
        assert b.text == a.text and b.text
        assert b.finish_reason == a.finish_reason
        assert b.completion_tokens == a.completion_tokens
        assert b.cached_tokens is not None and b.cached_tokens >= (a.cached_tokens or 0)  # the same prompt again
        assert 1 <= len(b.token_times) <= MAX_TOKENS  # chunks: the server relays tokens that queued as one
        assert b.sent <= b.token_times[0] <= b.token_times[-1]


def test_a_cancelled_light_stream_stops_and_a_refused_one_records_the_error(server: ServerThread) -> None:
    model = served_name(server)
    (cancelled,) = run_streams(server.base_url, model, PROMPTS[:1], 200, 1, {0: 2}, client=StreamClient.LIGHT)
    assert cancelled.cancelled and cancelled.error is None
    assert 2 <= len(cancelled.token_times) < 200 and cancelled.completion_tokens is None
    (refused,) = run_streams(server.base_url, "no-such-model", PROMPTS[:1], 4, 1, client=StreamClient.LIGHT)
    assert refused.error is not None and refused.error.startswith("HTTP 404") and "no-such-model" in refused.error
    assert not refused.token_times and not refused.completed


def served_name(server: ServerThread) -> str:
    assert server.parts is not None
    return server.parts.served.name
