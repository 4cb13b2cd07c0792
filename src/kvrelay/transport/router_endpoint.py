"""The router's WebSocket endpoint where workers connect (the live ``transport`` interpreter).

Follows the seed's Kabel router middleware (docs/design.md, seed note): heartbeats
are bound to the exact connection that carried them, silent workers expire,
disconnects become fenced worker-unavailable events, and unrelated traffic
passes through unchanged.

Contract:
- Listens on ``host`` (127.0.0.1 by default) at ``path`` (``/workers``), so an
  HTTP ingress can later share the host. The handshake must carry
  ``Authorization: Bearer <shared secret>``: a missing or non-bearer header is
  refused with HTTP 401, a wrong secret with 403, another path with 404; every
  refusal is logged (warning, with the peer address, never the presented
  value) and counted (``handshake_unauthorized``, ``handshake_forbidden``,
  ``handshake_wrong_path``).
- Each binary frame is read with ``frames.read_frame``. A heartbeat that the
  ``ConnectionTable`` accepts moves the worker's route to this connection
  (a connection it displaced is closed with code 4001) and then goes to
  ``sink.receive``; other worker messages go to ``sink.receive`` only when
  ``table.admit`` lets them through. A heartbeat refused because its epoch is
  fenced (its route ended) is answered on its connection with a ``Fenced``
  notice (counted ``fenced_notices``), so a worker whose connection outlived
  its epoch moves to a newer one. Everything else is dropped and counted in
  ``counters`` under its reason: frame verdicts, table refusals,
  ``wrong_direction`` (an offer or cancel sent by a worker), ``unknown_type``
  (an extension frame when no hook is installed).
- Extension frames (msgpack maps whose ``type`` is not a protocol type) go,
  unchanged, to ``on_extension(connection_id, frame)``; ``send_extension``
  writes raw frames back on that connection. Extension frames bypass the
  protocol codec: what they carry is the hook owner's business (they share the
  frame size limit). Protocol messages always go through the codec.
- A frame over ``max_frame_bytes`` closes only its connection, by websockets'
  own limit: close code 1009 with a reason that names both sizes ("... exceeds
  limit of M bytes"), counted as ``oversized``. After ``max_bad_frames`` dropped frames a connection is closed
  with 1008 (policy violation) naming the last reason: a peer that keeps
  sending garbage is broken, and closing it bounds the work it causes. Other
  connections are never touched.
- When a connection closes, and only if it still holds its worker's route, the
  sink gets ``worker_unavailable(worker_id, epoch)`` for that route's epoch.
- Every ``sweep_s`` the endpoint asks ``is_live(worker_id, epoch)`` for each
  route (for a ``ClusterRouter``: its registry, which the router's own Tick
  expires); a route whose worker is no longer live ends, and its connection is
  closed with code 4002, so the worker reconnects and must come back with a
  newer epoch (a fenced epoch is refused, here and in the registry). Without
  ``is_live`` (a sink that is not a ``ClusterRouter``) routes end only by close.
- A sink or hook callback that raises is logged and counted
  (``callback_errors``); the connection keeps serving.
- ``send(worker_id, message)`` (the ``ClusterRouter`` send callback) encodes with
  the codec and queues the frame on the route's connection; with no route it
  drops and counts ``send_no_route`` (the router's offer timer re-routes). An
  outbox that overflows closes its connection (4003).

Authenticated peers are trusted with their identity: the secret admits a
worker, and a peer holding it can claim any worker id with a newer epoch.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from http import HTTPStatus
from typing import Protocol

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from kvrelay.protocol.codec import DEFAULT_MAX_FRAME_BYTES, encode
from kvrelay.protocol.messages import (
    Cancel,
    Fenced,
    Heartbeat,
    Offer,
    OfferResult,
    Residency,
    WireMessage,
)
from kvrelay.router.cluster_router import ClusterRouter
from kvrelay.transport.auth import check_authorization
from kvrelay.transport.connections import ClaimReason, ConnectionTable
from kvrelay.transport.frames import Extension, Malformed, Outbox, read_frame

log = logging.getLogger(__name__)

CLOSE_REPLACED = 4001
CLOSE_EXPIRED = 4002
CLOSE_OVERFLOW = 4003
CLOSE_POLICY = 1008


class WorkerMessageSink(Protocol):
    """What the endpoint feeds: ``ClusterRouter`` or anything with these two methods."""

    def receive(self, message: WireMessage) -> None: ...

    def worker_unavailable(self, worker_id: str, epoch: int) -> None: ...


ExtensionHook = Callable[[int, bytes], None]
Liveness = Callable[[str, int], bool]


def registry_liveness(router: ClusterRouter) -> Liveness:
    """Whether ``worker_id`` is live in ``epoch`` in the router's discovery registry."""

    def is_live(worker_id: str, epoch: int) -> bool:
        entry = router.state.registry.live_entry(worker_id)
        return entry is not None and entry.epoch == epoch

    return is_live


class _Peer:
    def __init__(self, connection: ServerConnection, outbox: Outbox) -> None:
        self.connection = connection
        self.outbox = outbox
        self.bad_frames = 0


class RouterEndpoint:
    """Serves worker connections for one sink (see the module contract)."""

    def __init__(
        self,
        secret: bytes,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        path: str = "/workers",
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        max_bad_frames: int = 32,
        outbox_frames: int = 4096,
        sweep_s: float = 0.25,
        on_extension: ExtensionHook | None = None,
    ) -> None:
        if not secret:
            raise ValueError("the router endpoint needs a non-empty shared secret (see transport.auth.load_secret)")
        self._secret = secret
        self.host = host
        self.port = port
        self.path = path
        self.max_frame_bytes = max_frame_bytes
        self.max_bad_frames = max_bad_frames
        self._outbox_frames = outbox_frames
        self._sweep_s = sweep_s
        self._on_extension = on_extension
        self.table = ConnectionTable()
        self.counters: dict[str, int] = {}
        self._peers: dict[int, _Peer] = {}
        self._ids = itertools.count(1)
        self._sink: WorkerMessageSink | None = None
        self._is_live: Liveness | None = None
        self._server: Server | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()
        self._changed = asyncio.Event()

    @property
    def url(self) -> str:
        return f"ws://{self.host}:{self.port}{self.path}"

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n
        self._changed.set()

    async def wait_until(self, predicate: Callable[[], bool], timeout_s: float) -> None:
        """Return once ``predicate()`` holds (checked at each counter change); TimeoutError after ``timeout_s``."""
        async with asyncio.timeout(timeout_s):
            while not predicate():
                self._changed.clear()
                await self._changed.wait()

    # --- lifecycle ------------------------------------------------------------

    async def start(self, sink: WorkerMessageSink, is_live: Liveness | None = None) -> None:
        """Listen; feed ``sink``. ``is_live`` defaults to the registry of a ``ClusterRouter`` sink."""
        self._sink = sink
        self._is_live = is_live or (registry_liveness(sink) if isinstance(sink, ClusterRouter) else None)
        self._server = await serve(
            self._serve_connection,
            self.host,
            self.port,
            process_request=self._check_handshake,
            max_size=self.max_frame_bytes,
            compression=None,
            server_header=None,
        )
        self.port = self._server.sockets[0].getsockname()[1]
        if self._is_live is not None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())
        log.info("router endpoint listening on %s", self.url)

    async def close(self) -> None:
        """Stop listening and close every connection (workers see code 1001)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            try:
                await self._sweeper
            except asyncio.CancelledError:
                pass
        self._sweeper = None
        if self._server is not None:
            self._server.close(close_connections=True, reason="router endpoint shutting down")
            await self._server.wait_closed()
            self._server = None

    # --- handshake ------------------------------------------------------------

    def _check_handshake(self, connection: ServerConnection, request: Request) -> Response | None:
        if request.path != self.path:
            self.count("handshake_wrong_path")
            log.warning(
                "refused handshake from %s: path %r is not %r", connection.remote_address, request.path, self.path
            )
            return connection.respond(HTTPStatus.NOT_FOUND, f"workers connect at {self.path}\n")
        refusal = check_authorization(request.headers.get("Authorization"), self._secret)
        if refusal is None:
            return None
        self.count("handshake_unauthorized" if refusal.status == HTTPStatus.UNAUTHORIZED else "handshake_forbidden")
        log.warning("refused worker handshake from %s: %s", connection.remote_address, refusal.reason)
        return connection.respond(refusal.status, refusal.reason + "\n")

    # --- receiving --------------------------------------------------------------

    async def _serve_connection(self, connection: ServerConnection) -> None:
        cid = next(self._ids)
        peer = _Peer(connection, Outbox(connection, self._outbox_frames))
        self._peers[cid] = peer
        self.table.open(cid)
        self.count("connections_opened")
        try:
            async for frame in connection:
                self._on_frame(cid, peer, frame)
        except ConnectionClosed as exc:
            if exc.sent is not None and exc.sent.code == 1009:
                self.count("oversized")
                log.warning("closed connection %d: %s", cid, exc.sent.reason)
        finally:
            await peer.outbox.stop()
            del self._peers[cid]
            lost = self.table.close(cid)
            self.count("connections_closed")
            if lost is not None and self._sink is not None:
                log.info("worker %s (epoch %d) lost its connection", lost.worker_id, lost.epoch)
                self._guard(self._sink.worker_unavailable, lost.worker_id, lost.epoch)

    def _on_frame(self, cid: int, peer: _Peer, frame: bytes | str) -> None:
        item = read_frame(frame, self.max_frame_bytes)
        match item:
            case Malformed(reason=reason, detail=detail):
                self._reject(cid, peer, reason, detail)
            case Extension():
                if self._on_extension is None:
                    self._reject(cid, peer, "unknown_type", f"type {item.type!r} is not a protocol type")
                else:
                    self.count("extension_frames")
                    self._guard(self._on_extension, cid, item.frame)
            case Heartbeat():
                claim = self.table.bind_heartbeat(cid, item.worker_id, item.epoch, item.seq)
                if not claim.accepted:
                    if claim.reason is ClaimReason.FENCED_EPOCH:
                        self._notify_fenced(cid, item)
                    self._reject(cid, peer, claim.reason.value, f"heartbeat {item.worker_id} {(item.epoch, item.seq)}")
                    return
                if claim.displaced is not None:
                    self._close_peer(
                        claim.displaced,
                        CLOSE_REPLACED,
                        f"replaced by a newer connection of {item.worker_id} (epoch {item.epoch})",
                    )
                self.count("heartbeats")
                self._feed(item)
            case Offer() | Cancel() | Fenced():
                self._reject(cid, peer, "wrong_direction", f"{type(item).__name__} goes router -> worker")
            case _:
                epoch = item.epoch if isinstance(item, (OfferResult, Residency)) else None
                refused = self.table.admit(cid, item.worker_id, epoch)
                if refused is not None:
                    self._reject(cid, peer, refused.value, f"{type(item).__name__} of {item.worker_id}")
                    return
                self._feed(item)

    def _notify_fenced(self, cid: int, heartbeat: Heartbeat) -> None:
        """Tell the worker on ``cid`` that the epoch of its heartbeat is fenced here, so it starts a newer one."""
        self.count("fenced_notices")
        reason = f"epoch {heartbeat.epoch} of {heartbeat.worker_id} is fenced at this router; come back in a newer one"
        notice = Fenced(worker_id=heartbeat.worker_id, epoch=heartbeat.epoch, reason=reason[:256])
        self._put(cid, encode(notice, self.max_frame_bytes))

    def _feed(self, message: WireMessage) -> None:
        self.count("forwarded")
        if self._sink is not None:
            self._guard(self._sink.receive, message)

    def _guard(self, fn: Callable[..., object], *args: object) -> None:
        """Run a sink or hook callback; a failure is logged and counted, and the connection keeps serving."""
        try:
            fn(*args)
        except Exception:
            self.count("callback_errors")
            log.exception("callback %s failed", getattr(fn, "__qualname__", fn))

    def _reject(self, cid: int, peer: _Peer, reason: str, detail: str) -> None:
        self.count(reason)
        peer.bad_frames += 1
        log.debug("dropped frame on connection %d: %s: %s", cid, reason, detail)
        if peer.bad_frames == self.max_bad_frames:
            self.count("closed_bad_frames")
            log.warning("closing connection %d after %d dropped frames (last: %s)", cid, peer.bad_frames, reason)
            self._close_peer(cid, CLOSE_POLICY, f"{peer.bad_frames} dropped frames, last: {reason}")

    # --- sending ----------------------------------------------------------------

    def send(self, worker_id: str, message: WireMessage) -> None:
        """Queue ``message`` on the connection holding ``worker_id``'s route (the ClusterRouter callback)."""
        cid = self.table.route_of(worker_id)
        if cid is None or cid not in self._peers:
            self.count("send_no_route")
            log.debug("no route to worker %s for %s", worker_id, type(message).__name__)
            return
        self._put(cid, encode(message, self.max_frame_bytes))

    def send_extension(self, connection_id: int, frame: bytes) -> bool:
        """Queue a raw extension frame on ``connection_id``; False if that connection is gone."""
        if connection_id not in self._peers:
            return False
        return self._put(connection_id, frame)

    def _put(self, cid: int, frame: bytes) -> bool:
        outbox = self._peers[cid].outbox
        if outbox.put(frame):
            return True
        if outbox.stopped:
            self.count("send_connection_closing")
            return False
        self.count("send_overflow")
        self._close_peer(cid, CLOSE_OVERFLOW, "outbox overflow: the peer does not read its frames")
        return False

    def _close_peer(self, cid: int, code: int, reason: str) -> None:
        peer = self._peers.get(cid)
        if peer is not None:
            log.info("closing connection %d: %s", cid, reason)
            task = asyncio.get_running_loop().create_task(peer.connection.close(code, reason))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    # --- expiry -----------------------------------------------------------------

    async def _sweep_forever(self) -> None:
        assert self._is_live is not None
        while True:
            await asyncio.sleep(self._sweep_s)
            for worker_id, epoch, cid in self.table.held_routes():
                if not self._is_live(worker_id, epoch) and self.table.expire(worker_id, epoch) is not None:
                    self.count("routes_expired")
                    log.info("worker %s epoch %d expired; closing connection %d", worker_id, epoch, cid)
                    self._close_peer(cid, CLOSE_EXPIRED, f"worker {worker_id} epoch {epoch} expired")
