"""A TCP proxy the test controls: directed partitions, delay, jitter and reordering between connections.

``TcpProxy(target_port, target_host).start()`` listens on ``listen_host``
(``proxy.port``) and forwards every accepted connection to
``target_host:target_port``. With ``netns`` it runs inside that network
namespace (a ``testing.netns`` host), so a lab's hosts reach each other
through it. Its methods may be called from any thread; it runs its own event
loop in a thread.

- ``block("upstream")`` stops forwarding client -> target bytes
  (``"downstream"``: target -> client) on every connection, present and
  future; ``heal()`` opens both gates and removes any delay. A blocked
  direction holds what it has read and stops reading, so TCP backpressure
  holds the rest: nothing is lost or reordered, only delayed, as in a
  partition that heals.
- ``delay(base_s, jitter_s)`` holds every chunk read for ``base_s`` plus a
  uniform draw in ``[0, jitter_s]`` from ``random.Random(seed)``. TCP
  delivers one connection's bytes in order, so a chunk never overtakes an
  earlier one of its own connection (it leaves at the later of its own time
  and its predecessor's); chunks of different connections do overtake each
  other, which is the reordering a byte stream can see.

``forwarded[direction]`` counts the bytes delivered; ``connections`` the
connections accepted.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from concurrent.futures import Future
from typing import Any

from kvrelay.testing.netns import enter_netns

DIRECTIONS = ("upstream", "downstream")


class TcpProxy:
    def __init__(
        self,
        target_port: int,
        target_host: str = "127.0.0.1",
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        netns: str | None = None,
        seed: int = 0,
    ) -> None:
        self.target = (target_host, target_port)
        self.listen = (listen_host, listen_port)
        self.netns = netns
        self.port = 0
        self.forwarded = {d: 0 for d in DIRECTIONS}
        self.connections = 0
        self.delay_s = (0.0, 0.0)
        self._rng = random.Random(seed)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="tcp-proxy", daemon=True)
        self._gates: dict[str, asyncio.Event] = {}
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def _run(self) -> None:
        if self.netns is not None:
            enter_netns(self.netns)
        self._loop.run_forever()

    def start(self) -> TcpProxy:
        self._thread.start()
        self._call(self._start()).result(10)
        return self

    def block(self, direction: str) -> None:
        if direction not in DIRECTIONS:
            raise ValueError(f"direction {direction!r} is not one of {DIRECTIONS}")
        self._loop.call_soon_threadsafe(self._gates[direction].clear)

    def delay(self, base_s: float, jitter_s: float = 0.0) -> None:
        """Hold every chunk ``base_s`` plus up to ``jitter_s`` seconds from now on (see the module docstring)."""
        if base_s < 0 or jitter_s < 0:
            raise ValueError(f"delay and jitter must not be negative, got {base_s} and {jitter_s}")
        self.delay_s = (base_s, jitter_s)

    def heal(self) -> None:
        self.delay_s = (0.0, 0.0)
        for direction in DIRECTIONS:
            self._loop.call_soon_threadsafe(self._gates[direction].set)

    def close(self) -> None:
        self._call(self._stop()).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _call(self, coro: Any) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _start(self) -> None:
        self._gates = {d: asyncio.Event() for d in DIRECTIONS}
        for gate in self._gates.values():
            gate.set()
        self._server = await asyncio.start_server(self._accept, *self.listen)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        for direction, src, dst in (("upstream", reader, up_writer), ("downstream", up_reader, writer)):
            queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
            self._spawn(self._read(direction, src, queue))
            self._spawn(self._write(direction, dst, queue))

    def _due(self, previous: float) -> float:
        base, jitter = self.delay_s
        hold = base + (self._rng.uniform(0.0, jitter) if jitter else 0.0)
        return max(previous, time.monotonic() + hold)

    async def _read(
        self, direction: str, reader: asyncio.StreamReader, queue: asyncio.Queue[tuple[float, bytes]]
    ) -> None:
        gate = self._gates[direction]
        due = 0.0
        try:
            while True:
                await gate.wait()
                data = await reader.read(65536)
                if not data:
                    break
                due = self._due(due)
                queue.put_nowait((due, data))
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            queue.put_nowait((0.0, b""))

    async def _write(
        self, direction: str, writer: asyncio.StreamWriter, queue: asyncio.Queue[tuple[float, bytes]]
    ) -> None:
        gate = self._gates[direction]
        try:
            while True:
                due, data = await queue.get()
                if not data:
                    break
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                await gate.wait()
                writer.write(data)
                await writer.drain()
                self.forwarded[direction] += len(data)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
