"""An embedded server whose event loop really stalls past the worker expiry: the router's own tick comes that
late, so it counts the silence as its own pause, not the worker's (``Tick.late_s``): the worker keeps its epoch,
completions work at once after the stall, and the streams that were running finish with every token, in order;
none is lost. (A worker that is silent while the router runs is fenced: ``test_transport``, ``test_router``.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvrelay.protocol.messages import Heartbeat, WireMessage
from kvrelay.testing.tiny_models import make_tiny_model
from tests.support.processes import StreamingRequest, complete, wait_until
from tests.support.server_thread import ServerThread

pytestmark = pytest.mark.timeout(240)

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12] * 4
BUDGET = 200
STALL_S = 4.5
"""Longer than the router's worker expiry (3 s)."""
BACK_WITHIN_S = 5.0


def stall_after_next_heartbeat(server: ServerThread, seconds: float) -> threading.Event:
    """Block the server's event loop thread for ``seconds`` right after the router takes the worker's next
    heartbeat (a real stall: nothing on the loop runs meanwhile, as when a request handler holds it). Returns
    an event set when the stall is over. The next heartbeat is due only after the stall, and so is the router's
    tick, which then comes ``seconds`` late: the worker's silence is the router's own pause."""
    assert server.parts is not None
    router = server.parts.router
    receive: Callable[[WireMessage], None] = router.receive
    over = threading.Event()

    def stalling(message: WireMessage) -> None:
        receive(message)
        if isinstance(message, Heartbeat) and not over.is_set():
            time.sleep(seconds)
            router.receive = receive  # type: ignore[method-assign]
            over.set()

    server.call(setattr, router, "receive", stalling)
    return over


def test_a_loop_stalled_past_the_expiry_is_the_routers_pause_and_fences_nothing(tmp_path: Path) -> None:
    model = make_tiny_model(
        "llama",
        tmp_path / "slowllama",
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=6,
        max_position_embeddings=2048,
        eos_token_id=None,
    )
    with ServerThread(model, f"sqlite:///{tmp_path / 'facts.sqlite3'}") as server:
        assert server.parts is not None
        reference = complete(server.base_url, model.name, PROMPT, BUDGET)["choices"][0]["text"]
        epoch = server.call(lambda: server.parts.controller.epoch)  # type: ignore[union-attr]
        streams = [StreamingRequest(server.base_url, model.name, PROMPT, BUDGET) for _ in range(3)]
        assert all(s.first.wait(60) for s in streams)
        over = stall_after_next_heartbeat(server, STALL_S)
        assert over.wait(30)
        stalled_until = time.monotonic()

        def counters() -> dict[str, int]:
            return server.call(lambda: dict(server.parts.router.state.counters))  # type: ignore[no-any-return,union-attr]

        wait_until(lambda: counters().get("late_ticks", 0) >= 1 or None, 5, "the late tick to be counted")
        assert complete(server.base_url, model.name, PROMPT, 4)["usage"]["completion_tokens"] == 4
        assert time.monotonic() - stalled_until < BACK_WITHIN_S
        assert server.call(lambda: server.parts.controller.epoch) == epoch  # type: ignore[union-attr]
        for s in streams:  # every running stream finished, with every token, as the undisturbed request would
            assert s.result(120) == reference
            assert s.error_event is None and s.usage["completion_tokens"] == BUDGET  # type: ignore[index]
        final = counters()
        assert final.get("workers_expired", 0) == 0 and final.get("fenced_notices", 0) == 0, final
        assert final.get("finished_error", 0) == 0 and final.get("retries", 0) == 0, final
