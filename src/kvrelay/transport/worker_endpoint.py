"""The worker's side of the live transport: links to one or several routers.

Contract:
- One link per router URL. Each link connects with ``Authorization: Bearer
  <shared secret>``, and after a failed attempt or a lost connection retries
  after ``Backoff.delay``: exponential, capped at ``max_s``, jittered downwards
  by a ``random.Random(seed)``, so a test run is reproducible. A refused
  handshake (HTTP 401/403) is logged as an error and retried the same way.
- On every new connection the link sends ``host.heartbeat()`` at once, then
  the host's ``residency_snapshot()`` messages (if it defines it: what each
  of its tiers holds, so the router's index starts from the truth), then a
  heartbeat every ``heartbeat_interval_s``; each heartbeat is built by the
  host (fresh observations, next seq), so several routers see one growing
  sequence.
- Offers addressed to this worker go to ``host.on_offer(offer, reply)``, where
  ``reply`` writes OfferResult / Delta / Result back on the very connection the
  offer came from; cancels go to ``host.on_cancel``. Offers for another
  worker id are dropped and counted (``misdirected``).
- ``publish(message)`` (residency events) goes to every connected router.
- Messages produced while a connection is down (a ``reply`` on a closed link,
  a ``publish`` with no router connected) are dropped and counted under
  ``dropped_disconnected``, never queued for later: the router has fenced
  that epoch and re-routes the work anyway.
- When a connection is lost the host hears ``on_disconnect(router_url)`` (if it
  defines it). That
  router fences the epoch the connection carried and refuses its heartbeats
  afterwards, so a host that wants to be routed by it again must start a new
  epoch (and drop the work of the old one) before its next heartbeat. A router
  that refuses a heartbeat of a fenced epoch on a live connection answers with a
  ``Fenced`` notice, which goes to ``host.on_fenced`` (if it defines it); the
  link then sends ``host.heartbeat()`` and the residency snapshot at once, so
  the new epoch is routed, from the truth, without waiting for the next
  period. Epochs
  are per worker, not per router: with several routers, a new epoch also makes
  the others fence the old one (and re-route its work) at its next heartbeat.
- Every frame is encoded by ``protocol.codec.encode``: a message holding a
  local-only value (a timer, a reservation handle, tensor bytes) raises
  ``ProtocolError`` in the host's ``reply``/``publish`` call and is never sent.
- A host callback that raises is logged and counted (``host_errors``); the link
  keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import (
    ConnectionClosed,
    InvalidHandshake,
    InvalidStatus,
    InvalidURI,
)
from websockets.uri import parse_uri

from kvrelay.protocol.codec import DEFAULT_MAX_FRAME_BYTES, encode
from kvrelay.protocol.messages import Cancel, Fenced, Heartbeat, Offer, WireMessage
from kvrelay.transport.auth import bearer_header
from kvrelay.transport.frames import Extension, Malformed, Outbox, read_frame

log = logging.getLogger(__name__)

Reply = Callable[[WireMessage], bool]
"""Send a message back to the router the offer came from; False if it was dropped."""


class WorkerHost(Protocol):
    """What the worker endpoint drives (the worker-local controller implements it).

    A host may also define ``on_disconnect(router_url: str) -> None``; the
    endpoint calls it, when present, each time a connection to a router ends,
    and ``on_fenced(fenced: Fenced) -> None``, called with a router's notice
    that it fenced an epoch of this worker (see the module contract on epochs);
    and ``residency_snapshot() -> list[Residency]``, sent on each new
    connection after the first heartbeat.
    """

    worker_id: str
    epoch: int

    def heartbeat(self) -> Heartbeat:
        """Fresh observations with the next seq of the current epoch."""
        ...

    def on_offer(self, offer: Offer, reply: Reply) -> None: ...

    def on_cancel(self, cancel: Cancel) -> None: ...


@dataclass(frozen=True, slots=True)
class Backoff:
    """Reconnect delays: ``initial_s * factor**failures`` capped at ``max_s``, minus up to ``jitter`` of it."""

    initial_s: float = 0.05
    max_s: float = 2.0
    factor: float = 2.0
    jitter: float = 0.5

    def delay(self, failures: int, rng: random.Random) -> float:
        base = min(self.max_s, self.initial_s * self.factor ** min(failures, 64))
        return base * (1.0 - self.jitter * rng.random())


class _Link:
    """One live connection to one router."""

    def __init__(self, endpoint: WorkerEndpoint, url: str, connection: ClientConnection, outbox: Outbox) -> None:
        self.endpoint = endpoint
        self.url = url
        self.connection = connection
        self.outbox = outbox
        self.open = True

    def send(self, message: WireMessage) -> bool:
        frame = encode(message, self.endpoint.max_frame_bytes)
        if self.open and self.outbox.put(frame):
            return True
        self.endpoint.count("dropped_disconnected" if not self.open or self.outbox.stopped else "send_overflow")
        return False


class WorkerEndpoint:
    """Keeps ``host`` linked to every router in ``router_urls`` (see the module contract)."""

    def __init__(
        self,
        host: WorkerHost,
        router_urls: Sequence[str],
        secret: bytes,
        *,
        heartbeat_interval_s: float = 0.5,
        backoff: Backoff = Backoff(),
        seed: int = 0,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        outbox_frames: int = 4096,
        open_timeout_s: float = 5.0,
    ) -> None:
        if not router_urls:
            raise ValueError("a worker needs at least one router URL, e.g. ws://127.0.0.1:8700/workers")
        for url in router_urls:
            try:
                parse_uri(url)
            except InvalidURI as exc:
                raise ValueError(f"router URL {url!r} is not usable: {exc}; expected ws://HOST:PORT/workers") from None
        self._host = host
        self.router_urls = tuple(router_urls)
        self._secret = secret
        self.heartbeat_interval_s = heartbeat_interval_s
        self.backoff = backoff
        self._rng = random.Random(seed)
        self.max_frame_bytes = max_frame_bytes
        self._outbox_frames = outbox_frames
        self._open_timeout_s = open_timeout_s
        self._links: dict[str, _Link] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self.counters: dict[str, int] = {}
        self.last_close: dict[str, tuple[int | None, str]] = {}
        """Per router URL: the close code and reason of the last connection that ended."""
        self._changed = asyncio.Event()

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n
        self._changed.set()

    def connected(self) -> list[str]:
        return sorted(self._links)

    async def wait_until(self, predicate: Callable[[], bool], timeout_s: float) -> None:
        """Return once ``predicate()`` holds (checked at each counter change); TimeoutError after ``timeout_s``."""
        async with asyncio.timeout(timeout_s):
            while not predicate():
                self._changed.clear()
                await self._changed.wait()

    # --- lifecycle ------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._run_link(url)) for url in self.router_urls]

    async def close(self) -> None:
        """Close every link (code 1000) and stop reconnecting."""
        self._closing = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    # --- sending ----------------------------------------------------------------

    def publish(self, message: WireMessage) -> int:
        """Send ``message`` to every connected router; the number of routers it was queued for."""
        frame = encode(message, self.max_frame_bytes)
        sent = sum(1 for link in list(self._links.values()) if link.open and link.outbox.put(frame))
        # A full outbox (a router that stopped reading) is counted with the disconnected ones.
        if sent < len(self.router_urls):
            self.count("dropped_disconnected", len(self.router_urls) - sent)
        return sent

    # --- links ------------------------------------------------------------------

    async def _run_link(self, url: str) -> None:
        failures = 0
        while not self._closing:
            try:
                async with connect(
                    url,
                    additional_headers=[bearer_header(self._secret)],
                    max_size=self.max_frame_bytes,
                    compression=None,
                    proxy=None,
                    open_timeout=self._open_timeout_s,
                    close_timeout=1.0,
                ) as connection:
                    failures = 0
                    await self._serve_link(url, connection)
            except InvalidStatus as exc:
                self.count("handshake_refused")
                log.error(
                    "router %s refused the handshake: HTTP %d; check the shared secret and the path",
                    url,
                    exc.response.status_code,
                )
            except (OSError, TimeoutError, InvalidHandshake, ConnectionClosed) as exc:
                self.count("connect_failed")
                log.info("cannot reach router %s: %s", url, exc)
            if self._closing:
                return
            delay = self.backoff.delay(failures, self._rng)
            failures += 1
            await asyncio.sleep(delay)

    async def _serve_link(self, url: str, connection: ClientConnection) -> None:
        link = _Link(self, url, connection, Outbox(connection, self._outbox_frames))
        self._links[url] = link
        self.count("connected")
        beats = asyncio.get_running_loop().create_task(self._heartbeat_forever(link))
        try:
            async for frame in connection:
                self._on_frame(link, frame)
        except ConnectionClosed:
            pass
        finally:
            link.open = False
            beats.cancel()
            await asyncio.gather(beats, return_exceptions=True)
            await link.outbox.stop()
            del self._links[url]
            self.last_close[url] = (connection.close_code, connection.close_reason or "")
            log.info(
                "connection to router %s ended: code %s %s", url, connection.close_code, connection.close_reason or ""
            )
            on_disconnect = getattr(self._host, "on_disconnect", None)
            if on_disconnect is not None and not self._closing:
                self._call_host(on_disconnect, url)
            self.count("disconnected")

    def _announce(self, link: _Link) -> None:
        """A heartbeat of the current epoch, then the host's residency snapshot (if it defines one)."""
        self._call_host(lambda: link.send(self._host.heartbeat()))
        snapshot = getattr(self._host, "residency_snapshot", None)
        if snapshot is not None:
            self._call_host(lambda: [link.send(message) for message in snapshot()])

    async def _heartbeat_forever(self, link: _Link) -> None:
        self._announce(link)
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            self._call_host(lambda: link.send(self._host.heartbeat()))

    def _on_frame(self, link: _Link, frame: bytes | str) -> None:
        item = read_frame(frame, self.max_frame_bytes)
        match item:
            case Offer():
                if item.worker_id != self._host.worker_id:
                    self.count("misdirected")
                    return
                self._call_host(self._host.on_offer, item, link.send)
            case Cancel():
                self._call_host(self._host.on_cancel, item)
            case Fenced():
                if item.worker_id != self._host.worker_id:
                    self.count("misdirected")
                    return
                self.count("fenced_notices")
                on_fenced = getattr(self._host, "on_fenced", None)
                if on_fenced is None:
                    return
                self._call_host(on_fenced, item)
                self._announce(link)  # the new epoch and what the worker holds, at once
            case Malformed(reason=reason):
                self.count(reason)
            case Extension():
                self.count("unknown_type")
            case _:
                self.count("wrong_direction")

    def _call_host(self, fn: Callable[..., object], *args: object) -> None:
        try:
            fn(*args)
        except Exception:
            self.count("host_errors")
            log.exception("worker host callback %s failed", getattr(fn, "__qualname__", fn))
