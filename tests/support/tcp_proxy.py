"""A loopback TCP proxy the test controls, for directed partitions.

``TcpProxy(target_port).start()`` listens on 127.0.0.1 (``proxy.port``) and
forwards every accepted connection to ``127.0.0.1:target_port``. Each
direction has a gate: ``block("upstream")`` stops forwarding client -> target
bytes (``"downstream"``: target -> client) on every connection, present and
future; ``heal()`` opens both gates. A blocked direction holds the bytes it
has read and stops reading, so TCP backpressure holds the rest: nothing is
lost or reordered, it is delayed, as in a real partition that heals. The
proxy runs its own event loop in a thread; its methods may be called from any
thread. ``forwarded[direction]`` counts the bytes delivered.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from typing import Any

DIRECTIONS = ("upstream", "downstream")


class TcpProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self.forwarded = {d: 0 for d in DIRECTIONS}
        self.connections = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tcp-proxy", daemon=True)
        self._gates: dict[str, asyncio.Event] = {}
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self) -> TcpProxy:
        self._thread.start()
        self._call(self._start()).result(10)
        return self

    def block(self, direction: str) -> None:
        if direction not in DIRECTIONS:
            raise ValueError(f"direction {direction!r} is not one of {DIRECTIONS}")
        self._loop.call_soon_threadsafe(self._gates[direction].clear)

    def heal(self) -> None:
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
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        for task in (self._pump("upstream", reader, up_writer), self._pump("downstream", up_reader, writer)):
            started = asyncio.get_running_loop().create_task(task)
            self._tasks.add(started)
            started.add_done_callback(self._tasks.discard)

    async def _pump(self, direction: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        gate = self._gates[direction]
        try:
            while True:
                await gate.wait()
                data = await reader.read(65536)
                if not data:
                    break
                await gate.wait()
                writer.write(data)
                await writer.drain()
                self.forwarded[direction] += len(data)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
