"""The status page's tap and JSON over a real ClusterRouter: timelines across attempts, the infinite-cache bound,
hit shares, TTFT percentiles, and explanations equal to what ``kvrelay explain`` reads from the fact store."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec

from kvrelay.core.router.events import Outcome, Request
from kvrelay.core.router.machine import RouterConfig, new_router
from kvrelay.dashboard.snapshot import cluster_state, request_detail
from kvrelay.dashboard.tap import ClusterTap, prefix_ids
from kvrelay.facts.explain import explain_lines
from kvrelay.facts.queries import FactReader
from kvrelay.facts.sink import record_sink
from kvrelay.facts.store import FactStore
from kvrelay.protocol.chunk_keys import prompt_chain
from kvrelay.protocol.messages import Delta, Offer, OfferResult, Residency, Result, Timings, Usage
from kvrelay.router.cluster_router import ClusterRouter, Consumer
from tests.support.router_driver import heartbeat
from tests.unit.test_cluster_router import Inbox

PROMPT = tuple(range(200))
"""Three full 64-token chunks are routable (the last token is always computed)."""


async def _serve(router: ClusterRouter, inbox: Inbox, rid: str, decline_first: bool, cached: int) -> Outcome:
    """Submit ``rid``; decline its first offer when asked, then accept, stream two deltas and a result."""
    done: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
    router.submit(Request(rid, "m", PROMPT, 3), Consumer(lambda i, t: None, done.set_result))
    wid, offer = await inbox.next(Offer)
    assert isinstance(offer, Offer)
    if decline_first:
        router.receive(
            OfferResult(assignment=offer.assignment, worker_id=wid, epoch=1, accepted=False, reason="no_pages")
        )
        wid, offer = await inbox.next(Offer)
        assert isinstance(offer, Offer)
    router.receive(OfferResult(assignment=offer.assignment, worker_id=wid, epoch=1, accepted=True))
    router.receive(Delta(assignment=offer.assignment, worker_id=wid, seq=0, tokens=(7,)))
    router.receive(Delta(assignment=offer.assignment, worker_id=wid, seq=1, tokens=(8, 9)))
    router.receive(
        Result(
            assignment=offer.assignment,
            worker_id=wid,
            tokens=(7, 8, 9),
            finish_reason="length",
            usage=Usage(prompt_tokens=len(PROMPT), cached_tokens={"ram": cached}, recomputed_tokens=200 - cached),
            timings=Timings(queue_s=0.001, restore_s=0.004, prefill_s=0.01, ttft_s=0.02),
        )
    )
    return await asyncio.wait_for(done, 2.0)


def test_tap_follows_attempts_bound_hits_and_explains_as_the_store_does(tmp_path: Path) -> None:
    store = FactStore(f"sqlite:///{tmp_path / 'facts.sqlite3'}")

    async def scenario() -> tuple[dict, dict, dict]:
        inbox = Inbox()
        router = ClusterRouter(new_router(RouterConfig(offer_timeout_s=5.0)), inbox.send, record_sink(store))
        tap = ClusterTap(lambda: router.state)
        router.observers.append(tap.observe)
        router.receive(heartbeat("w0"))
        router.receive(heartbeat("w1"))
        first = await _serve(router, inbox, "r1", decline_first=True, cached=0)
        # w1 holds the prompt's first two chunks on device: r2's route restores them.
        keys = prompt_chain(b"m", PROMPT, 64)[:2]
        router.receive(Residency(worker_id="w1", epoch=1, seq=1, tier="gpu", model="m", stored=keys))
        second = await _serve(router, inbox, "r2", decline_first=False, cached=128)
        assert first.attempts == 2 and second.attempts == 1
        assert router.callback_errors == 0
        state = msgspec.json.decode(msgspec.json.encode(cluster_state(router.state, tap)))
        one = request_detail(tap, "r1")
        two = request_detail(tap, "r2")
        assert one is not None and two is not None and request_detail(tap, "nobody") is None
        await router.close()
        return state, one, two

    state, one, two = asyncio.run(scenario())
    assert sorted(state["workers"]) == ["w0", "w1"]
    assert all(w["epoch"] == 1 and w["heartbeat_age_s"] is not None for w in state["workers"].values())
    # r1's three routable chunks were new; r2's were all seen before: a bound of 3 x 64 tokens.
    assert [r["request_id"] for r in state["requests"]] == ["r2", "r1"]
    assert [r["bound_tokens"] for r in state["requests"]] == [192, 0]
    hits = state["hits"]
    assert (hits["prompt_tokens"], hits["cached_tokens"], hits["bound_tokens"]) == (400, 128, 192)
    assert hits["hit_share"] == 128 / 400 and hits["bound_share"] == 192 / 400
    assert state["ttft"]["count"] == 2 and state["ttft"]["p50_ms"] is not None
    # r1: declined on one worker, served on the other; every decision names its winner and why the other lost.
    decisions = state["requests"][1]["decisions"]
    assert [d["attempt"] for d in decisions] == [1, 2]
    assert decisions[0]["offer"].startswith("declined by") and decisions[1]["offer"].startswith("accepted by")
    assert decisions[0]["winner"] != decisions[1]["winner"]
    for decision in decisions:
        winners = [c for c in decision["candidates"] if c["winner"]]
        assert [c["worker_id"] for c in winners] == [decision["winner"]]
        assert all(c["lost_because"] for c in decision["candidates"] if not c["winner"])
    kinds = [(m["attempt"], m["kind"]) for m in one["timeline"]]
    assert kinds == [
        (0, "arrived"),
        (1, "offered"),
        (1, "declined"),
        (2, "offered"),
        (2, "accepted"),
        (2, "restore"),
        (2, "first_token"),
        (2, "deltas"),
        (0, "ended"),
    ]
    offsets = [m["offset_ms"] for m in one["timeline"]]
    assert offsets == sorted(offsets) and offsets[0] == 0.0
    assert [m["text"] for m in two["timeline"] if m["kind"] == "offered"] == ["offered to w1 (epoch 1): gpu x2"]
    assert two["decisions"][0]["winner_route"].startswith("gpu x2"), two["decisions"][0]
    assert "3 token(s)" in one["timeline"][7]["text"] and "ram 128" not in one["timeline"][5]["text"]
    restore = [m["text"] for m in two["timeline"] if m["kind"] == "restore"]
    assert len(restore) == 1 and "cached ram 128" in restore[0] and "restore on w" in restore[0]
    # The page's explanation is the one `kvrelay explain` prints from the store for the same records.
    assert store.close(30.0)
    reader = FactReader(store.engine)
    for detail in (one, two):
        stored = reader.request_history(detail["request_id"])
        assert stored is not None
        assert detail["explain"] == explain_lines(stored)
    store.engine.dispose()


def test_prefix_ids_stand_for_whole_prefixes_under_a_fingerprint() -> None:
    base = tuple(range(300))
    fork = base[:128] + tuple(range(1000, 1172))
    ids, forked = prefix_ids(b"m", base, 64), prefix_ids(b"m", fork, 64)
    assert len(ids) == 4 and len(forked) == 4
    assert ids[:2] == forked[:2] and all(a != b for a, b in zip(ids[2:], forked[2:]))
    assert not set(prefix_ids(b"other", base, 64)) & set(ids)
    assert prefix_ids(b"m", base[:65], 64) == ids[:1] and prefix_ids(b"m", base[:64], 64) == []
