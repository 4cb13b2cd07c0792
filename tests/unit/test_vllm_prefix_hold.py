"""A vLLM worker holds a request that shares a prefix with one still computing it until that one has its first
token: a real worker host against a loopback engine that records when each request arrives."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvrelay.engines.vllm import host as host_module
from kvrelay.engines.vllm.admission import EngineIdentity, prefix_to_await
from kvrelay.engines.vllm.client import EngineClient
from kvrelay.engines.vllm.host import VllmWorker
from kvrelay.engines.vllm.metrics import EngineFigures
from kvrelay.protocol.messages import Assignment, Offer
from tests.support.sse_engine import DONE, USAGE, chunk, chunked_head, engine, token

FP = b"vllm-fp-16-bytes"
BS = 4
FIRST = tuple(range(100, 113))  # three full blocks and one token
FOLLOWER = (*FIRST[:12], 7, 8)  # the same three blocks, then its own
LONG = tuple(range(100, 501))  # a hundred blocks and one token
# At the engine's fitted 1 ms a token the first has 13 ms of prefill, less what the worker's clock says passed
# (the held scenarios move it on by a second), and the follower would compute 12 of its tokens again.


def test_the_prefix_to_await_is_the_longest_shared_with_a_computing_request_beyond_what_is_resident() -> None:
    a, b, c, d, e = (bytes([i]) * 16 for i in range(5))
    assert prefix_to_await((a, b, c, d), 0, [(a, b, e), (a, b, c)]) == 3
    assert prefix_to_await((a, b, c, d), 3, [(a, b, c)]) == 0  # the engine holds it already
    assert prefix_to_await((a, b, c, d), 1, [(e, b, c)]) == 0  # nothing shared from the first chunk
    assert prefix_to_await((a, b), 0, []) == 0


def offer(rid: str, prompt: tuple[int, ...]) -> Offer:
    return Offer(
        assignment=Assignment(rid, 1),
        worker_id="v1",
        epoch=5,
        model="m",
        model_fingerprint=FP.hex(),
        prompt=prompt,
        max_new_tokens=1,
    )


async def hold_scenario(
    release_after_s: float | None,
    first: tuple[int, ...] = FIRST,
    follower: tuple[int, ...] = FOLLOWER,
    advance_s: float = 1.0,
) -> tuple[VllmWorker, list[str], float | None]:
    """The first request reaches the engine and waits there for its first token; the follower is offered next.
    With ``release_after_s``, the engine answers the first request once the follower has not reached it for that
    long. Returns the host, the order requests reached the engine, and the follower's wait after that answer."""
    arrived: list[str] = []
    first_arrived, follower_arrived, release = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def handler(body: dict[str, object], writer: asyncio.StreamWriter) -> None:
        mine = "first" if tuple(body["prompt"]) == first else "follower"  # type: ignore[arg-type]
        arrived.append(mine)
        (first_arrived if mine == "first" else follower_arrived).set()
        if mine == "first":
            await release.wait()
        writer.write(chunked_head() + chunk(token(1, finish="length") + USAGE + DONE) + b"0\r\n\r\n")
        await writer.drain()

    async with engine(handler) as url:
        identity = EngineIdentity("v1", 5, "m", FP, context_limit=1024, block_tokens=BS)
        moved = [0.0]
        figures = EngineFigures(num_blocks=256, block_size=BS)
        host = VllmWorker(
            identity, EngineClient(url), "served", 64, 4, figures, clock=lambda: time.monotonic() + moved[0]
        )
        replies: list[object] = []
        host.on_offer(offer("first", first), replies.append)
        await asyncio.wait_for(first_arrived.wait(), 5)
        moved[0] = advance_s
        host.on_offer(offer("follower", follower), replies.append)
        waited: float | None = None
        if release_after_s is not None:
            with pytest.raises(TimeoutError):  # held: it does not reach the engine meanwhile
                await asyncio.wait_for(follower_arrived.wait(), release_after_s)
            start = asyncio.get_running_loop().time()
            release.set()
            await asyncio.wait_for(follower_arrived.wait(), 5)
            waited = asyncio.get_running_loop().time() - start
        else:
            await asyncio.wait_for(follower_arrived.wait(), 5)
        release.set()
        await asyncio.wait_for(asyncio.gather(*(r.task for r in list(host.runs.values()) if r.task)), 5)
        await host.engine.close()
        return host, arrived, waited


def test_a_follower_reaches_the_engine_once_its_predecessor_has_its_first_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(host_module, "HOLD_MIN_S", 30.0)
    host, arrived, waited = asyncio.run(hold_scenario(release_after_s=0.3))
    assert arrived == ["first", "follower"] and waited is not None and waited < 5
    assert host.counters.get("held_for_prefix") == 1 and "hold_timed_out" not in host.counters


def test_a_hold_is_bounded_and_the_follower_goes_without_the_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_module, "HOLD_MIN_S", 0.05)
    host, arrived, _ = asyncio.run(hold_scenario(release_after_s=None))
    assert arrived == ["first", "follower"]
    assert host.counters.get("held_for_prefix") == 1 and host.counters.get("hold_timed_out") == 1


def test_a_follower_sharing_less_than_its_predecessor_has_left_to_compute_is_not_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(host_module, "HOLD_MIN_S", 30.0)
    scenario = hold_scenario(release_after_s=None, first=LONG, follower=(*LONG[:4], 7, 8, 9, 10), advance_s=0.0)
    host, arrived, _ = asyncio.run(scenario)
    assert arrived == ["first", "follower"]  # reached the engine while the first was still before its first token
    assert host.counters.get("not_held_longer_than_recompute") == 1 and "held_for_prefix" not in host.counters
