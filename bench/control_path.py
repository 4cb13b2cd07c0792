"""Router overhead on the live control path, over loopback WebSockets, with worker processes.

The router (this process) runs a ``ClusterRouter`` behind a ``RouterEndpoint``;
``--workers`` separate processes each run a ``WorkerEndpoint`` whose trivial
host answers every offer at once: accept, then ``--deltas`` one-token deltas
``--delta-interval-ms`` apart (a decode step), then the result.
Requests arrive open-loop at ``--rate`` per second.

Measured, per request and per delta:
- offer: from just before ``ClusterRouter.submit`` (request arrival at the
  router) to the worker host's ``on_offer`` in the worker process (the frame
  is received and decoded);
- delta: from just before the worker host's ``reply(Delta)`` (encode, queue,
  send) to the consumer's ``on_delta`` callback in the router process.

Clocks: both ends read ``time.monotonic()``, which on Linux is
``CLOCK_MONOTONIC``: one system-wide clock shared by every process on the
machine, so stamps taken in different processes subtract directly.

Baseline, measured in the same run and at the same time: a bare websockets
echo in a separate process (no auth, no codec, no router), pinged from the
router process at the same rate; its one-way times out (client send to server
receive) and back (server send to client receive).

    .venv/bin/python bench/control_path.py [--workers 4] [--rate 200] [--requests 2000] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from websockets.asyncio.client import connect
from websockets.asyncio.server import serve

from kvrelay.bench.report import Figure, report
from kvrelay.core.router.events import Outcome, Request
from kvrelay.core.router.machine import RouterConfig, new_router
from kvrelay.protocol.messages import (
    Cancel,
    Delta,
    Heartbeat,
    Offer,
    OfferResult,
    Result,
)
from kvrelay.router.cluster_router import ClusterRouter, Consumer
from kvrelay.transport.auth import load_secret
from kvrelay.transport.router_endpoint import RouterEndpoint
from kvrelay.transport.worker_endpoint import Reply, WorkerEndpoint

STAMP = struct.Struct("<d")


# --- worker process --------------------------------------------------------------


class ImmediateHost:
    """Accepts each offer at once, then sends one-token deltas ``interval_s`` apart and the result;
    stamps offer arrival and each delta's send."""

    def __init__(self, worker_id: str, deltas: int, interval_s: float) -> None:
        self.worker_id = worker_id
        self.epoch = 1
        self.seq = 0
        self.deltas = deltas
        self.interval_s = interval_s
        self.stamps: dict[str, dict[str, object]] = {}

    def heartbeat(self) -> Heartbeat:
        self.seq += 1
        return Heartbeat(
            worker_id=self.worker_id,
            epoch=self.epoch,
            seq=self.seq,
            models=("m",),
            pages_total=100_000,
            pages_free=100_000,
            max_lanes=64,
            prefill_s_per_token=1e-5,
            decode_s_per_token=1e-3,
            context_limit=100_000,
        )

    def on_offer(self, offer: Offer, reply: Reply) -> None:
        offer_at = time.monotonic()
        a = offer.assignment
        reply(OfferResult(assignment=a, worker_id=self.worker_id, epoch=self.epoch, accepted=True))
        sent: list[float] = []
        self.stamps[a.request_id] = {"offer_at": offer_at, "delta_sent": sent}
        tokens = tuple(range(min(self.deltas, offer.max_new_tokens)))
        loop = asyncio.get_running_loop()

        def send_delta(seq: int) -> None:
            sent.append(time.monotonic())
            reply(Delta(assignment=a, worker_id=self.worker_id, seq=seq, tokens=(tokens[seq],)))
            if seq + 1 < len(tokens):
                loop.call_later(self.interval_s, send_delta, seq + 1)
            else:
                reply(Result(assignment=a, worker_id=self.worker_id, tokens=tokens, finish_reason="length"))

        loop.call_later(self.interval_s, send_delta, 0)

    def on_cancel(self, cancel: Cancel) -> None:
        pass

    def on_disconnect(self, router_url: str) -> None:
        self.epoch += 1
        self.seq = 0


async def worker_process(url: str, worker_id: str, deltas: int, interval_s: float, stamps_path: str) -> None:
    host = ImmediateHost(worker_id, deltas, interval_s)
    endpoint = WorkerEndpoint(host, [url], load_secret(), heartbeat_interval_s=0.5, seed=hash(worker_id) % 1000)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await endpoint.start()
    await stop.wait()
    await endpoint.close()
    Path(stamps_path).write_text(json.dumps(host.stamps))


async def echo_process() -> None:
    """A bare websockets echo: answers each stamp with (receive time, send time)."""

    async def echo(connection) -> None:  # type: ignore[no-untyped-def]
        async for frame in connection:
            received = time.monotonic()
            await connection.send(frame + STAMP.pack(received) + STAMP.pack(time.monotonic()))

    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with serve(echo, "127.0.0.1", 0, compression=None) as server:
        print(server.sockets[0].getsockname()[1], flush=True)
        await stop.wait()


# --- router process ----------------------------------------------------------------


def spawn(*args: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, __file__, *args], env=env, stdout=subprocess.PIPE)


async def measure_echo(port: int, count: int, rate: float) -> tuple[list[float], list[float]]:
    out, back = [], []
    async with connect(f"ws://127.0.0.1:{port}", compression=None, proxy=None) as ws:
        start = time.monotonic()
        for i in range(count):
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
            sent = time.monotonic()
            await ws.send(STAMP.pack(sent))
            reply = await ws.recv()
            got = time.monotonic()
            _, received, resent = struct.unpack("<ddd", reply)
            out.append(received - sent)
            back.append(got - resent)
    return out, back


async def drive(
    router: ClusterRouter, count: int, rate: float, prefix: str, deltas: int
) -> tuple[dict[str, float], dict[str, list[float]], list[Outcome]]:
    """Submit ``count`` requests open-loop at ``rate``; arrival and per-delta receive stamps, outcomes."""
    arrivals: dict[str, float] = {}
    received: dict[str, list[float]] = {}
    outcomes: list[Outcome] = []
    all_done = asyncio.Event()

    def consumer(rid: str) -> Consumer:
        stamps = received.setdefault(rid, [])

        def on_result(outcome: Outcome) -> None:
            outcomes.append(outcome)
            if len(outcomes) == count:
                all_done.set()

        return Consumer(lambda index, tokens: stamps.append(time.monotonic()), on_result)

    start = time.monotonic()
    for i in range(count):
        await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
        rid = f"{prefix}{i}"
        request = Request(rid, "m", (i % 50_000, 1, 2, 3, 4, 5, 6, 7), deltas)
        handler = consumer(rid)
        arrivals[rid] = time.monotonic()
        router.submit(request, handler)
    await asyncio.wait_for(all_done.wait(), 30)
    return arrivals, received, outcomes


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def router_process(args: argparse.Namespace) -> list[Figure]:
    secret = secrets.token_urlsafe(32)
    env = {**os.environ, "KVRELAY_SECRET": secret}
    endpoint = RouterEndpoint(secret.encode())
    router = ClusterRouter(new_router(RouterConfig()), endpoint.send)
    await endpoint.start(router)
    router.start()
    tmp = Path(tempfile.mkdtemp(prefix="kvrelay-control-path-"))
    children = [
        spawn(
            "--worker-process",
            endpoint.url,
            f"w{i}",
            str(tmp / f"w{i}.json"),
            str(args.deltas),
            str(args.delta_interval_ms / 1e3),
            env=env,
        )
        for i in range(args.workers)
    ]
    echo = spawn("--echo-process", env=env)
    try:
        await endpoint.wait_until(lambda: len(endpoint.table.routes) == args.workers, 60)
        assert echo.stdout is not None
        echo_port = int(await asyncio.wait_for(asyncio.to_thread(echo.stdout.readline), 60))
        await drive(router, args.warmup, args.rate, "warm", args.deltas)
        # The baseline runs alongside, at the same rate, so both see the same machine load.
        (arrivals, received, outcomes), (echo_out, echo_back) = await asyncio.gather(
            drive(router, args.requests, args.rate, "r", args.deltas), measure_echo(echo_port, args.requests, args.rate)
        )
    finally:
        for child in [*children, echo]:
            child.send_signal(signal.SIGTERM)
        for child in [*children, echo]:
            child.wait(30)
        await endpoint.close()
        await router.close()
    by_worker = [json.loads((tmp / f"w{i}.json").read_text()) for i in range(args.workers)]
    stamps: dict[str, dict[str, object]] = {rid: s for worker in by_worker for rid, s in worker.items()}
    offer_s = [float(stamps[rid]["offer_at"]) - arrivals[rid] for rid in arrivals]  # type: ignore[arg-type]
    delta_s = [got - sent for rid in arrivals for got, sent in zip(received[rid], stamps[rid]["delta_sent"])]  # type: ignore[arg-type]
    failed = sum(1 for o in outcomes if o.finish_reason != "length")
    per_worker = [sum(1 for rid in arrivals if rid in worker) for worker in by_worker]
    print(
        f"{len(outcomes)} requests, {failed} failed, {len(delta_s)} deltas; requests per worker {per_worker}; "
        f"{os.cpu_count()} CPUs; router counters {endpoint.counters}"
    )
    ms = 1e3
    base_out, base_back = statistics.median(echo_out) * ms, statistics.median(echo_back) * ms
    base_out99, base_back99 = pct(echo_out, 0.99) * ms, pct(echo_back, 0.99) * ms
    return [
        Figure("offer_delivery_median", statistics.median(offer_s) * ms, "ms", "ws_echo_one_way_out_median", base_out),
        Figure("offer_delivery_p99", pct(offer_s, 0.99) * ms, "ms", "ws_echo_one_way_out_p99", base_out99),
        Figure(
            "delta_to_consumer_median", statistics.median(delta_s) * ms, "ms", "ws_echo_one_way_back_median", base_back
        ),
        Figure("delta_to_consumer_p99", pct(delta_s, 0.99) * ms, "ms", "ws_echo_one_way_back_p99", base_back99),
        Figure("failed_requests", failed, "requests", "requests_submitted", len(arrivals)),
    ]


def main() -> None:
    if sys.argv[1:2] == ["--worker-process"]:
        url, worker_id, stamps_path, deltas, interval_s = sys.argv[2:7]
        asyncio.run(worker_process(url, worker_id, int(deltas), float(interval_s), stamps_path))
        return
    if sys.argv[1:2] == ["--echo-process"]:
        asyncio.run(echo_process())
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rate", type=float, default=200.0, help="requests per second, open loop")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--deltas", type=int, default=4, help="one-token deltas per request")
    parser.add_argument("--delta-interval-ms", type=float, default=5.0, help="time between a worker's deltas")
    parser.add_argument("--json", default=None, help="write the figures as JSON to this path")
    args = parser.parse_args()
    figures = asyncio.run(router_process(args))
    report(
        f"control path over loopback: {args.workers} worker processes, {args.rate:g} requests/s, "
        f"{args.requests} requests",
        figures,
        args.json,
    )


if __name__ == "__main__":
    main()
