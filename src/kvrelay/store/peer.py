"""The ``peer`` tier: a worker serves its ram and ssd chunks over HTTP; another fetches them.

Server: ``PeerServer(sources)`` listens on 127.0.0.1 (by default) in its own
threads and answers ``GET /chunks/<key hex>`` with the stored form of the chunk
(``application/octet-stream``) from the first source that holds a verified copy,
``404`` when none does, and ``400`` for a malformed key. ``HEAD`` answers the same
without a body. An optional ``?fingerprint=<hex>`` query makes the server check
the model fingerprint too.

Client: ``PeerTier(base_url)`` is a read-only ``ChunkSource`` for the peer the
router named. Every request has a timeout; a timeout, a refused connection or a
bad answer is a miss (logged and counted as an error), and a chunk that fails
verification is a miss reported through ``on_corrupt`` (the peer owns its copy).
The client keeps its connections open between requests (HTTP/1.1 keep-alive, at
most ``IDLE_CONNECTIONS`` idle), so a restore of many chunks pays one connection
and the server one handler thread; a request whose kept connection the server
closed is sent once more on a new one (a timeout is not). ``PeerServer.close``
also ends the connections it holds open.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import socket
import sys
import threading
import urllib.parse
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kvrelay.protocol.chunk_keys import DIGEST_BYTES
from kvrelay.store.chunk_format import ChunkView
from kvrelay.store.tier import ChunkSource, CorruptionListener, Counters, TierCounters

log = logging.getLogger(__name__)

CHUNK_PATH = "/chunks/"
IDLE_CONNECTIONS = 4
"""Connections a ``PeerTier`` keeps open for its next requests."""


def _parse_request(path: str) -> tuple[bytes, bytes | None] | None:
    """``(key, fingerprint or None)`` from ``/chunks/<hex>[?fingerprint=<hex>]``, or None if malformed."""
    parts = urllib.parse.urlsplit(path)
    if not parts.path.startswith(CHUNK_PATH):
        return None
    try:
        key = bytes.fromhex(parts.path[len(CHUNK_PATH) :])
        query = urllib.parse.parse_qs(parts.query)
        fingerprint = bytes.fromhex(query["fingerprint"][0]) if "fingerprint" in query else None
    except ValueError:
        return None
    return (key, fingerprint) if len(key) == DIGEST_BYTES else None


class _ChunkHTTPServer(ThreadingHTTPServer):
    """A threading HTTP server whose failed connections are logged, not printed: a client that drops a kept
    connection (or a ``close`` that ends one) is routine, at debug; anything else is a warning."""

    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        error = sys.exc_info()[1]
        level = logging.DEBUG if isinstance(error, ConnectionError) else logging.WARNING
        log.log(level, "peer server: the connection from %s ended: %r", client_address, error, exc_info=True)


class PeerServer:
    """Serves the chunks of ``sources`` (fastest first) over HTTP until ``close``."""

    def __init__(self, sources: Sequence[ChunkSource], host: str = "127.0.0.1", port: int = 0) -> None:
        self._sources = tuple(sources)
        self._counters = Counters()
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()
        self._httpd = _ChunkHTTPServer((host, port), self._handler_class())
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, args=(0.05,), name="kvrelay-peer-server", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def counters(self) -> TierCounters:
        """Chunks served (``hits``, ``bytes_read``), not found (``misses``), malformed requests (``errors``)."""
        return self._counters.snapshot()

    def lookup(self, key: bytes, fingerprint: bytes | None) -> ChunkView | None:
        for source in self._sources:
            view = source.get(key, fingerprint)
            if view is not None:
                return view
        return None

    def close(self) -> None:
        """Stop accepting, end the connections held open, and wait for the accepting thread."""
        self._httpd.shutdown()
        self._httpd.server_close()
        with self._open_lock:
            held = list(self._open)
        for sock in held:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._thread.join()

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class ChunkHandler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                with server._open_lock:
                    server._open.add(self.connection)

            def finish(self) -> None:
                with server._open_lock:
                    server._open.discard(self.connection)
                super().finish()

            def _answer(self, with_body: bool) -> None:
                parsed = _parse_request(self.path)
                if parsed is None:
                    server._counters.add(errors=1)
                    self._plain(400, f"expected {CHUNK_PATH}<{2 * DIGEST_BYTES} hex digits>, got {self.path}")
                    return
                view = server.lookup(*parsed)
                if view is None:
                    server._counters.add(misses=1)
                    self._plain(404, f"chunk {parsed[0].hex()} is not held here")
                    return
                if with_body:  # counted before the answer, so a client that has its answer sees the count
                    server._counters.add(hits=1, bytes_read=view.nbytes)
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(view.nbytes))
                self.end_headers()
                if with_body:
                    self.wfile.write(memoryview(view.buffer))

            def _plain(self, status: int, text: str) -> None:
                body = text.encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                self._answer(with_body=True)

            def do_HEAD(self) -> None:  # noqa: N802
                self._answer(with_body=False)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002
                log.debug("peer server: " + format, *args)

        return ChunkHandler


class PeerTier(ChunkSource):
    """Read-only access to the chunks of the peer at ``base_url`` (``http://host:port``)."""

    name = "peer"

    def __init__(self, base_url: str, timeout_s: float = 5.0, on_corrupt: CorruptionListener | None = None) -> None:
        super().__init__(on_corrupt)
        parts = urllib.parse.urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"peer URL {base_url!r} must look like http://host:port")
        self.base_url = base_url
        self._host = parts.hostname
        self._port = parts.port or 80
        self.timeout_s = timeout_s
        self._idle: list[http.client.HTTPConnection] = []
        self._idle_lock = threading.Lock()

    def _request(self, method: str, key: bytes, fingerprint: bytes | None) -> tuple[int, bytearray]:
        path = CHUNK_PATH + key.hex() + (f"?fingerprint={fingerprint.hex()}" if fingerprint is not None else "")
        with self._idle_lock:
            kept = self._idle.pop() if self._idle else None
        if kept is not None:
            try:
                return self._exchange(kept, method, path)
            except (ConnectionError, http.client.BadStatusLine):
                pass  # the server closed the kept connection: once more on a new one (a timeout is not retried)
        return self._exchange(http.client.HTTPConnection(self._host, self._port, timeout=self.timeout_s), method, path)

    def _exchange(self, conn: http.client.HTTPConnection, method: str, path: str) -> tuple[int, bytearray]:
        """One request and its whole answer on ``conn``, which is kept for the next request if both ends allow."""
        keep = False
        try:
            conn.request(method, path)
            response = conn.getresponse()
            if response.status != 200 or method == "HEAD":
                response.read()
                keep = not response.will_close
                return response.status, bytearray()
            length = int(response.getheader("Content-Length", "-1"))
            if length < 0:
                raise http.client.HTTPException("peer answered without Content-Length")
            buffer = bytearray(length)
            view = memoryview(buffer)
            pos = 0
            while pos < length:
                n = response.readinto(view[pos:])
                if not n:
                    raise http.client.IncompleteRead(b"", length - pos)
                pos += n
            keep = not response.will_close
            return 200, buffer
        finally:
            with self._idle_lock:
                keep = keep and len(self._idle) < IDLE_CONNECTIONS
                if keep:
                    self._idle.append(conn)
            if not keep:
                conn.close()

    def get(self, key: bytes, fingerprint: bytes | None = None) -> ChunkView | None:
        try:
            status, buffer = self._request("GET", key, fingerprint)
        except (OSError, http.client.HTTPException) as err:
            log.warning("peer %s did not deliver chunk %s: %s", self.base_url, key.hex(), err)
            self._counters.add(errors=1, misses=1)
            return None
        if status != 200:
            if status != 404:
                log.warning("peer %s answered %d for chunk %s", self.base_url, status, key.hex())
                self._counters.add(errors=1)
            self._counters.add(misses=1)
            return None
        view = self._verify(buffer, key, fingerprint, source=self.base_url)
        if view is not None:
            self._counters.add(hits=1, bytes_read=view.nbytes)
        return view

    def contains(self, key: bytes) -> bool:
        try:
            status, _ = self._request("HEAD", key, None)
        except (OSError, http.client.HTTPException):
            self._counters.add(errors=1)
            return False
        return status == 200
