"""The live WebSocket transport between a ClusterRouter and worker endpoints, over loopback."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus

from kvrelay.core.router.machine import RouterConfig
from kvrelay.protocol.codec import ProtocolError, encode
from kvrelay.protocol.messages import (
    Assignment,
    Delta,
    Fenced,
    Heartbeat,
    OfferResult,
    Residency,
)
from kvrelay.transport.auth import SecretError, check_authorization, load_secret
from kvrelay.transport.router_endpoint import (
    CLOSE_EXPIRED,
    CLOSE_REPLACED,
    RouterEndpoint,
)
from kvrelay.transport.worker_endpoint import Backoff, WorkerEndpoint
from tests.support.router_driver import heartbeat
from tests.support.transport_peers import (
    FAST_BACKOFF,
    SECRET,
    PlainHost,
    RouterSide,
    ScriptedHost,
    pack,
    raw_peer,
    start_worker,
    token_at,
)


def run(scenario: Callable[[], Awaitable[None]], timeout_s: float = 20.0) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(timeout_s):
            await scenario()

    asyncio.run(bounded())


def expected(n: int) -> list[int]:
    return [token_at(i) for i in range(n)]


def test_offer_accept_deltas_result_reach_the_consumer() -> None:
    async def scenario() -> None:
        side = await RouterSide().start()
        host = ScriptedHost("w0")
        worker = await start_worker(host, side.url)
        await side.wait_route("w0", 1)
        stream = side.submit("r1", max_new=5)
        outcome = await stream.outcome()
        assert outcome.finish_reason == "length" and outcome.attempts == 1
        assert stream.tokens == expected(5) and list(outcome.tokens) == expected(5)
        assert host.offers[0].assignment.request_id == "r1"
        # Residency published by the host reaches the router's index.
        assert worker.publish(Residency(worker_id="w0", epoch=1, seq=1, tier="ram", stored=(b"k" * 16,))) == 1
        index = side.router.state.index
        await side.endpoint.wait_until(
            lambda: any(w == "w0" for v in index.lookup([b"k" * 16]) for w, _ in index.holders(v)), 5
        )
        await worker.close()
        await side.close()

    run(scenario)


def test_handshake_without_or_with_a_wrong_secret_is_refused_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        side = await RouterSide().start()
        with pytest.raises(InvalidStatus) as missing:
            await raw_peer(side.url, secret=None)
        assert missing.value.response.status_code == 401
        with pytest.raises(InvalidStatus) as wrong:
            await raw_peer(side.url, secret=b"wrong-secret-0123456789abcdef")
        assert wrong.value.response.status_code == 403
        with pytest.raises(InvalidStatus) as elsewhere:
            await raw_peer(side.url.replace("/workers", "/other"))
        assert elsewhere.value.response.status_code == 404
        assert side.endpoint.counters["handshake_unauthorized"] == 1
        assert side.endpoint.counters["handshake_forbidden"] == 1
        assert "connections_opened" not in side.endpoint.counters
        # A worker with the wrong secret keeps being refused and never gets a route.
        worker = WorkerEndpoint(ScriptedHost("w0"), [side.url], b"wrong-secret-0123456789abcdef", backoff=FAST_BACKOFF)
        await worker.start()
        await worker.wait_until(lambda: worker.counters.get("handshake_refused", 0) >= 2, 5)
        assert side.endpoint.table.route_of("w0") is None
        await worker.close()
        await side.close()

    with caplog.at_level(logging.WARNING, logger="kvrelay.transport.router_endpoint"):
        run(scenario)
    refusals = [r.getMessage() for r in caplog.records if "refused worker handshake" in r.getMessage()]
    assert any("missing Authorization" in m for m in refusals) and any("wrong shared secret" in m for m in refusals)
    assert all(SECRET.decode() not in m for m in refusals)


def test_an_oversized_frame_closes_only_its_connection_with_a_clear_reason() -> None:
    async def scenario() -> None:
        side = await RouterSide(max_frame_bytes=64 * 1024).start()
        worker = await start_worker(ScriptedHost("w0"), side.url)
        await side.wait_route("w0", 1)
        peer = await raw_peer(side.url)
        await peer.send(b"\x00" * (64 * 1024 + 1))
        with pytest.raises(ConnectionClosed):
            await peer.recv()
        assert peer.close_code == 1009
        assert "exceeds limit of 65536 bytes" in (peer.close_reason or "")
        await side.endpoint.wait_until(lambda: side.endpoint.counters.get("oversized", 0) == 1, 5)
        outcome = await side.submit("after", max_new=3).outcome()
        assert list(outcome.tokens) == expected(3) and worker.counters["connected"] == 1
        await worker.close()
        await side.close()

    run(scenario)


def test_malformed_frames_are_counted_per_reason_and_other_connections_keep_serving() -> None:
    async def scenario() -> None:
        side = await RouterSide(max_bad_frames=8).start()
        worker = await start_worker(ScriptedHost("w0"), side.url)
        await side.wait_route("w0", 1)
        peer = await raw_peer(side.url)
        hb = pack({"type": "heartbeat", "v": 1, "worker_id": "x"})
        bad = [
            b"\xc1 not msgpack",  # not_msgpack
            pack([1, 2, 3]),  # no_type
            pack({"type": "gossip", "v": 1}),  # unknown_type (no hook installed)
            pack({**msgspec_heartbeat("x"), "v": 9}),  # wrong_version
            hb,  # invalid_fields
            encode(Delta(assignment=Assignment("r", 1), worker_id="w0", seq=0, tokens=(1,))),  # unbound
        ]
        for frame in bad:
            await peer.send(frame)
        await peer.send("text")  # text_frame
        counters = side.endpoint.counters
        reasons = ["not_msgpack", "no_type", "unknown_type", "wrong_version", "invalid_fields", "unbound", "text_frame"]
        await side.endpoint.wait_until(lambda: all(counters.get(r) == 1 for r in reasons), 5)
        outcome = await side.submit("r", max_new=3).outcome()
        assert list(outcome.tokens) == expected(3)
        # The eighth dropped frame closes the offender (policy violation), and only it.
        await peer.send(b"\xc1")
        with pytest.raises(ConnectionClosed):
            await peer.recv()
        assert peer.close_code == 1008 and "8 dropped frames" in (peer.close_reason or "")
        assert list((await side.submit("r2", max_new=2).outcome()).tokens) == expected(2)
        assert side.unavailable == []
        await worker.close()
        await side.close()

    run(scenario)


def msgspec_heartbeat(worker_id: str) -> dict[str, object]:
    return msgspec.to_builtins(heartbeat(worker_id))


def test_a_disconnect_fences_the_epoch_and_the_request_continues_on_another_worker() -> None:
    async def scenario() -> None:
        side = await RouterSide().start()
        first_host = ScriptedHost("w0", script={"r": "hold"}, hold_after=2)
        first = await start_worker(first_host, side.url)
        await side.wait_route("w0", 1)
        stream = side.submit("r", max_new=6)
        await first_host.next_offer()
        await side.endpoint.wait_until(lambda: len(stream.tokens) == 2, 5)
        second_host = ScriptedHost("w1")
        second = await start_worker(second_host, side.url)
        await side.wait_route("w1", 1)
        await first.close()
        outcome = await stream.outcome()
        assert side.unavailable == [("w0", 1)]
        assert outcome.attempts == 2 and stream.tokens == expected(6)
        continuation = second_host.offers[0]
        assert continuation.generated_before == 2 and continuation.max_new_tokens == 4
        await second.close()
        await side.close()

    run(scenario)


def test_stale_connections_never_remove_or_replace_a_newer_route() -> None:
    async def scenario() -> None:
        side = await RouterSide().start()
        old_host = ScriptedHost("w0", epoch=1, new_epoch_on_disconnect=False)
        old = await start_worker(old_host, side.url)
        await side.wait_route("w0", 1)
        old_cid = side.endpoint.table.route_of("w0")
        # The same worker restarts in epoch 2 on a new connection: the old one is displaced and closed.
        new_host = ScriptedHost("w0", epoch=2)
        new = await start_worker(new_host, side.url)
        await side.wait_route("w0", 2)
        await old.wait_until(lambda: side.url in old.last_close, 5)
        assert old.last_close[side.url] == (CLOSE_REPLACED, "replaced by a newer connection of w0 (epoch 2)")
        await side.endpoint.wait_until(lambda: old_cid not in side.endpoint.table.bindings, 5)
        # The displaced connection's close reported nothing; the router fenced epoch 1 on its own.
        assert side.unavailable == []
        # The old process reconnects in epoch 1 and is refused; so is a replayed old-epoch heartbeat.
        peer = await raw_peer(side.url)
        await peer.send(encode(heartbeat("w0", epoch=1, seq=99)))
        await peer.send(encode(OfferResult(assignment=Assignment("r", 1), worker_id="w0", epoch=1, accepted=True)))
        await side.endpoint.wait_until(lambda: side.endpoint.counters.get("fenced_epoch", 0) >= 2, 5)
        assert side.endpoint.counters["unbound"] == 1
        await peer.close()
        await old.close()
        await side.endpoint.wait_until(lambda: side.endpoint.counters["connections_closed"] >= 3, 5)
        assert side.endpoint.table.route_of("w0") is not None
        assert side.unavailable == []
        stream = side.submit("r", max_new=3)
        assert list((await stream.outcome()).tokens) == expected(3)
        assert new_host.offers[-1].epoch == 2
        await new.close()
        await side.close()

    run(scenario)


def test_workers_reconnect_with_backoff_after_the_router_restarts() -> None:
    async def scenario() -> None:
        side = await RouterSide().start()
        port = side.endpoint.port
        # w0 starts a new epoch on disconnect; w1 has no on_disconnect and keeps epoch 1 (a fresh router
        # has fenced nothing, so both are welcome).
        hosts = [ScriptedHost("w0"), PlainHost(ScriptedHost("w1"))]
        workers = [await start_worker(h, side.url, seed=i) for i, h in enumerate(hosts)]
        for h in hosts:
            await side.wait_route(h.worker_id, 1)
        assert list((await side.submit("before", max_new=2).outcome()).tokens) == expected(2)
        await side.close()
        for w in workers:
            await w.wait_until(lambda w=w: w.counters.get("connect_failed", 0) >= 2, 5)
        restarted = await RouterSide(port=port).start()
        await restarted.wait_route("w0", 2)
        await restarted.wait_route("w1", 1)
        outcomes = [await restarted.submit(f"after{i}", max_new=3).outcome() for i in range(4)]
        assert all(list(o.tokens) == expected(3) for o in outcomes)
        assert all(w.counters["connected"] == 2 for w in workers)
        for w in workers:
            await w.close()
        await restarted.close()

    run(scenario)


def test_backoff_grows_exponentially_is_bounded_and_seeded() -> None:
    policy = Backoff(initial_s=0.1, max_s=1.0, factor=2.0, jitter=0.5)
    delays = [policy.delay(n, random.Random(7)) for n in range(10)]
    bases = [min(1.0, 0.1 * 2**n) for n in range(10)]
    assert all(b * 0.5 <= d <= b for d, b in zip(delays, bases))
    assert max(policy.delay(10_000, random.Random(1)) for _ in range(3)) <= 1.0
    assert [policy.delay(3, random.Random(5)) for _ in range(2)] == [policy.delay(3, random.Random(5))] * 2


def test_a_silent_worker_expires_its_connection_closes_and_it_returns_in_a_new_epoch() -> None:
    async def scenario() -> None:
        side = await RouterSide(RouterConfig(worker_expiry_s=0.3)).start()
        host = ScriptedHost("w0")
        worker = await start_worker(host, side.url, interval_s=5.0)
        await side.wait_route("w0", 1)
        await worker.wait_until(lambda: side.url in worker.last_close, 5)
        assert worker.last_close[side.url] == (CLOSE_EXPIRED, "worker w0 epoch 1 expired")
        assert side.router.state.counters["workers_expired"] == 1
        await side.wait_route("w0", 2)
        assert side.unavailable == []
        await worker.close()
        await side.close()

    run(scenario)


def test_unknown_type_frames_reach_the_extension_hook_unchanged() -> None:
    async def scenario() -> None:
        received: list[tuple[int, bytes]] = []
        arrived = asyncio.Event()

        def hook(connection_id: int, frame: bytes) -> None:
            received.append((connection_id, frame))
            arrived.set()

        side = await RouterSide(on_extension=hook).start()
        peer = await raw_peer(side.url)
        frame = pack({"type": "sync/konserve", "payload": b"\x00\x01", "n": [1, 2]})
        await peer.send(frame)
        await asyncio.wait_for(arrived.wait(), 5)
        cid, got = received[0]
        assert got == frame and side.endpoint.counters.get("unknown_type") is None
        assert side.endpoint.send_extension(cid, pack({"type": "sync/ack"}))
        assert await asyncio.wait_for(peer.recv(), 5) == pack({"type": "sync/ack"})
        await peer.close()
        await side.close()

    run(scenario)


def test_local_only_values_never_leave_a_worker() -> None:
    async def scenario() -> None:
        side = await RouterSide().start()
        worker = await start_worker(ScriptedHost("w0"), side.url)
        await side.wait_route("w0", 1)
        with pytest.raises(ProtocolError):
            worker.publish(
                Heartbeat(
                    worker_id="w0",
                    epoch=1,
                    seq=5,
                    models=(asyncio.Event(),),  # type: ignore
                    pages_total=1,
                    pages_free=1,
                )
            )
        await worker.close()
        await side.close()

    run(scenario)


def test_endpoints_refuse_unusable_configuration() -> None:
    with pytest.raises(ValueError, match="non-empty shared secret"):
        RouterEndpoint(b"")
    with pytest.raises(ValueError, match="router URL 'http://127.0.0.1:1/workers' is not usable"):
        WorkerEndpoint(ScriptedHost("w0"), ["http://127.0.0.1:1/workers"], SECRET)


def test_one_worker_serves_several_routers_and_replies_go_where_the_offer_came_from() -> None:
    async def scenario() -> None:
        a, b = await RouterSide().start(), await RouterSide().start()
        # Keeps its epoch when b goes away, so router a keeps routing to epoch 1.
        host = ScriptedHost("w0", new_epoch_on_disconnect=False)
        worker = await start_worker(host, a.url, b.url)
        await a.wait_route("w0", 1)
        await b.wait_route("w0", 1)
        from_a, from_b = a.submit("same-id", max_new=2), b.submit("same-id", max_new=3)
        assert list((await from_a.outcome()).tokens) == expected(2)
        assert list((await from_b.outcome()).tokens) == expected(3)
        residency = Residency(worker_id="w0", epoch=1, seq=1, tier="ram", stored=(b"k" * 16,))
        assert worker.publish(residency) == 2
        await b.close()
        await worker.wait_until(lambda: worker.connected() == [a.url], 5)
        # While b is down, what goes to it is dropped and counted, not queued.
        assert worker.publish(residency) == 1 and worker.counters["dropped_disconnected"] == 1
        assert list((await a.submit("again", max_new=2).outcome()).tokens) == expected(2)
        await worker.close()
        await a.close()

    run(scenario)


def test_the_shared_secret_comes_from_a_file_or_the_environment(tmp_path: Path) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_text("file-secret-0123456789abcdef\n")
    assert load_secret(secret_file, environ={}) == b"file-secret-0123456789abcdef"
    assert load_secret(environ={"KVRELAY_SECRET_FILE": str(secret_file)}) == b"file-secret-0123456789abcdef"
    assert load_secret(environ={"KVRELAY_SECRET": " env-secret-0123456789abcdef "}) == b"env-secret-0123456789abcdef"
    with pytest.raises(SecretError, match="no shared secret configured"):
        load_secret(environ={})
    with pytest.raises(SecretError, match="at least 16"):
        load_secret(environ={"KVRELAY_SECRET": "short"})
    with pytest.raises(SecretError, match="cannot read the secret file"):
        load_secret(tmp_path / "missing", environ={})
    assert check_authorization("Bearer file-secret-0123456789abcdef", b"file-secret-0123456789abcdef") is None
    assert check_authorization("Bearer file-secret-0123456789abcdeX", b"file-secret-0123456789abcdef") is not None
    assert check_authorization("Basic abc", b"file-secret-0123456789abcdef") is not None


def test_the_control_path_benchmark_runs_end_to_end(tmp_path: Path) -> None:
    """A smoke run at tiny size: the figures are printed and written, not asserted."""
    out = tmp_path / "figures.json"
    bench = Path(__file__).resolve().parents[2] / "bench" / "control_path.py"
    done = subprocess.run(
        [
            sys.executable,
            str(bench),
            "--workers",
            "2",
            "--requests",
            "20",
            "--warmup",
            "4",
            "--rate",
            "100",
            "--json",
            str(out),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert {f["name"] for f in figures} >= {"offer_delivery_median", "delta_to_consumer_median"}
    assert all(set(f) == {"name", "value", "unit", "baseline", "baseline_value"} for f in figures)


class FenceAwareHost(ScriptedHost):
    """A worker host that keeps its epoch when a link drops, but moves on when a router says it was fenced."""

    def __init__(self, worker_id: str) -> None:
        super().__init__(worker_id, new_epoch_on_disconnect=False)
        self.fenced: list[int] = []
        self.snapshots: list[int] = []

    def residency_snapshot(self) -> list[Residency]:
        self.snapshots.append(self.epoch)
        return []

    def on_fenced(self, fenced: Fenced) -> None:
        if fenced.epoch == self.epoch:
            self.fenced.append(fenced.epoch)
            self.epoch += 1
            self.seq = 0


def test_a_worker_linking_again_in_a_fenced_epoch_is_told_so_and_comes_back_in_a_newer_one() -> None:
    async def scenario() -> None:
        side = await RouterSide().start()
        host = FenceAwareHost("w0")
        first = await start_worker(host, side.url, interval_s=5.0)
        await side.wait_route("w0", 1)
        await first.close()  # the router sees the connection end and fences epoch 1
        await side.endpoint.wait_until(lambda: side.unavailable == [("w0", 1)], 5)
        second = await start_worker(host, side.url, interval_s=5.0)  # the same host links again, still in epoch 1
        await side.wait_route("w0", 2, timeout_s=2.0)  # well before its next periodic heartbeat
        assert host.fenced == [1] and side.endpoint.counters["fenced_notices"] == 1
        assert second.counters["fenced_notices"] == 1
        assert host.snapshots == [1, 1, 2]  # each new link, and the new epoch, start with what the worker holds
        assert list((await side.submit("r", max_new=3).outcome()).tokens) == expected(3)
        assert host.offers[-1].epoch == 2
        await second.close()
        await side.close()

    run(scenario)
