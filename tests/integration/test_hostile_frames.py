"""1,000 hostile frames and handshakes against a running router endpoint while 2 good workers serve 50 requests."""

from __future__ import annotations

import asyncio
import random

import msgspec
from websockets.exceptions import ConnectionClosed, InvalidStatus

from kvrelay.protocol.codec import encode
from kvrelay.protocol.messages import Assignment, Cancel, Delta, Offer, Result
from tests.support.router_driver import heartbeat
from tests.support.transport_peers import (
    RouterSide,
    ScriptedHost,
    pack,
    raw_peer,
    start_worker,
    token_at,
)

SEED = 7_202_611
HOSTILE_ACTIONS = 1000
HOSTILE_PEERS = 4
FRAMES_PER_CONNECTION = 31
"""At most one below the endpoint's ``max_bad_frames``: the peer closes first, so every frame is processed."""
MAX_FRAME = 128 * 1024
REQUESTS, WINDOW = 50, 5

DROP_REASONS = (
    "not_msgpack",
    "no_type",
    "unknown_type",
    "wrong_version",
    "invalid_fields",
    "unbound",
    "wrong_direction",
    "text_frame",
    "stale_heartbeat",
    "fenced_epoch",
    "identity_mismatch",
)


def hostile_frame(rng: random.Random) -> bytes | str:
    """One malformed, misdirected or replayed frame."""
    a = Assignment(f"r{rng.randrange(REQUESTS)}", rng.randint(1, 3))
    kind = rng.randrange(10)
    if kind == 0:
        return rng.randbytes(rng.randint(1, 300))
    if kind == 1:
        return pack(rng.choice([7, "heartbeat", [1, "offer"], None, {"type": 5}, {"kind": "delta"}]))
    if kind == 2:
        return pack({"type": rng.choice(["gossip", "sync", "HEARTBEAT", ""]), "v": 1})
    if kind == 3:
        return pack({**msgspec.to_builtins(heartbeat("w0")), "v": rng.choice([0, 2, 99])})
    if kind == 4:
        return pack({"type": rng.choice(["delta", "result", "residency"]), "v": 1, "worker_id": "w0"})
    if kind == 5:  # a worker message from a connection that never bound (forged result or delta)
        return encode(
            rng.choice(
                [
                    Delta(assignment=a, worker_id="w0", seq=0, tokens=(1,)),
                    Result(assignment=a, worker_id="w1", tokens=(1,), finish_reason="stop"),
                ]
            )
        )
    if kind == 6:
        return encode(
            rng.choice(
                [
                    Offer(assignment=a, worker_id="w0", epoch=1, model="m", prompt=(1, 2), max_new_tokens=1),
                    Cancel(assignment=a, worker_id="w1"),
                ]
            )
        )
    if kind == 7:
        return "text frame " + str(rng.random())
    # Replayed old-epoch and old-seq heartbeats of the good workers.
    return encode(heartbeat(rng.choice(["w0", "w1"]), epoch=rng.choice([0, 1]), seq=rng.randint(0, 1)))


class Hostility:
    def __init__(self, side: RouterSide, seed: int) -> None:
        self.side = side
        self.rng = random.Random(seed)
        self.remaining = HOSTILE_ACTIONS
        self.frames_sent = 0
        self.oversized = 0
        self.wrong_secrets = 0
        self.progress = asyncio.Event()

    def take(self) -> bool:
        if self.remaining == 0:
            return False
        self.remaining -= 1
        self.progress.set()
        return True

    async def wait_done(self, actions: int) -> None:
        while HOSTILE_ACTIONS - self.remaining < actions:
            self.progress.clear()
            await self.progress.wait()

    async def peer_forever(self) -> None:
        while self.remaining:
            roll = self.rng.random()
            if roll < 0.45 and self.take():
                self.wrong_secrets += 1
                try:
                    await raw_peer(self.side.url, secret=self.rng.randbytes(24).hex().encode())
                    raise AssertionError("a wrong secret was accepted")
                except InvalidStatus as exc:
                    assert exc.response.status_code == 403
                continue
            peer = await raw_peer(self.side.url)
            if roll < 0.6 and self.take():
                self.oversized += 1
                await peer.send(self.rng.randbytes(MAX_FRAME + self.rng.randint(1, 4096)))
                try:
                    await peer.recv()
                except ConnectionClosed:
                    pass
                assert peer.close_code == 1009
                continue
            for _ in range(self.rng.randint(1, FRAMES_PER_CONNECTION)):
                if not self.take():
                    break
                await peer.send(hostile_frame(self.rng))
                self.frames_sent += 1
            await peer.close()


def test_hostile_frames_do_not_fail_a_concurrent_workload() -> None:
    print(f"seed={SEED}")

    async def scenario() -> None:
        side = await RouterSide(max_frame_bytes=MAX_FRAME).start()
        hosts = [ScriptedHost("w0"), ScriptedHost("w1")]
        workers = [await start_worker(h, side.url, seed=i) for i, h in enumerate(hosts)]
        for h in hosts:
            await side.wait_route(h.worker_id, 1)
        hostility = Hostility(side, SEED)
        attackers = [asyncio.create_task(hostility.peer_forever()) for _ in range(HOSTILE_PEERS)]
        outcomes = []
        for round_no in range(REQUESTS // WINDOW):
            await hostility.wait_done(round_no * HOSTILE_ACTIONS // (REQUESTS // WINDOW))
            streams = [side.submit(f"r{round_no * WINDOW + i}", max_new=4) for i in range(WINDOW)]
            outcomes += [await s.outcome() for s in streams]
        await asyncio.gather(*attackers)

        assert len(outcomes) == REQUESTS
        assert all(
            o.finish_reason == "length" and list(o.tokens) == [token_at(i) for i in range(4)] for o in outcomes
        ), [o for o in outcomes if o.finish_reason != "length"]
        counters = side.endpoint.counters
        await side.endpoint.wait_until(
            lambda: sum(counters.get(r, 0) for r in DROP_REASONS) == hostility.frames_sent, 10
        )
        print(f"seed={SEED} router counters: {sorted(counters.items())}")
        assert counters.get("oversized", 0) == hostility.oversized
        assert counters.get("handshake_forbidden", 0) == hostility.wrong_secrets
        assert hostility.frames_sent + hostility.oversized + hostility.wrong_secrets == HOSTILE_ACTIONS
        assert side.unavailable == [] and all(w.counters["connected"] == 1 for w in workers)
        assert {side.endpoint.table.route_of(h.worker_id) for h in hosts} == {1, 2}
        for w in workers:
            await w.close()
        await side.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))
