"""Reading and writing protocol frames on one WebSocket connection.

``read_frame`` sorts one received frame into exactly one of:
- a wire message (``protocol.codec.decode`` accepted it);
- an ``Extension``: a msgpack map whose string ``type`` is not a protocol type.
  This is the concrete meaning of "other traffic" on a worker connection; the
  endpoint hands the frame, byte for byte, to its extension hook (or counts it
  as ``unknown_type`` when no hook is installed);
- a ``Malformed`` verdict with a counter name: ``text_frame``, ``oversized``,
  ``not_msgpack``, ``no_type`` (msgpack, but not a map with a string ``type``),
  ``wrong_version``, ``invalid_fields`` (a protocol type with a missing or
  mistyped field). ``read_frame`` never raises.

``Outbox`` keeps the frames for one connection in order, bounded, and writes
them from a single task, so the synchronous ``send`` callbacks of the router
and of worker hosts never await and never reorder.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import msgspec
from websockets.exceptions import ConnectionClosed

from kvrelay.protocol.codec import ProtocolError, decode
from kvrelay.protocol.messages import PROTOCOL_VERSION, WIRE_TYPES, WireMessage

log = logging.getLogger(__name__)

PROTOCOL_TYPES = frozenset(t.__struct_config__.tag for t in WIRE_TYPES)
"""The ``type`` tags of the protocol; every other string ``type`` is extension traffic."""


class _Peek(msgspec.Struct):
    type: str
    v: Any = None


@dataclass(frozen=True, slots=True)
class Extension:
    type: str
    frame: bytes


@dataclass(frozen=True, slots=True)
class Malformed:
    reason: str
    detail: str


def read_frame(frame: bytes | str, max_frame_bytes: int) -> WireMessage | Extension | Malformed:
    """Classify one received frame (see the module contract)."""
    if isinstance(frame, str):
        return Malformed("text_frame", "text frames are not protocol frames; send binary msgpack")
    if len(frame) > max_frame_bytes:
        return Malformed("oversized", f"frame of {len(frame)} bytes exceeds the limit of {max_frame_bytes}")
    try:
        return decode(frame, max_frame_bytes)
    except ProtocolError as exc:
        error = str(exc)
    try:
        peek = msgspec.msgpack.decode(frame, type=_Peek)
    except msgspec.ValidationError:
        return Malformed("no_type", "a frame is a msgpack map with a string 'type'")
    except msgspec.DecodeError:
        return Malformed("not_msgpack", error)
    if peek.type not in PROTOCOL_TYPES:
        return Extension(peek.type, bytes(frame))
    if peek.v is not None and peek.v != PROTOCOL_VERSION:
        return Malformed("wrong_version", error)
    return Malformed("invalid_fields", error)


class Outbox:
    """Ordered frames for one connection, at most ``limit`` waiting; one writer task sends them."""

    def __init__(self, connection: Any, limit: int) -> None:
        self._connection = connection
        self._queue: asyncio.Queue[bytes] = asyncio.Queue(limit)
        self._writer = asyncio.get_running_loop().create_task(self._write_forever())

    @property
    def stopped(self) -> bool:
        """The writer has stopped (the connection closed); nothing more will be sent."""
        return self._writer.done()

    def put(self, frame: bytes) -> bool:
        """Queue ``frame``; False when the outbox is full or the writer has stopped."""
        if self._writer.done():
            return False
        try:
            self._queue.put_nowait(frame)
        except asyncio.QueueFull:
            return False
        return True

    async def stop(self) -> None:
        self._writer.cancel()
        try:
            await self._writer
        except asyncio.CancelledError:
            pass

    async def _write_forever(self) -> None:
        while True:
            frame = await self._queue.get()
            try:
                await self._connection.send(frame)
            except ConnectionClosed:
                return
