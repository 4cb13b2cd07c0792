"""What crosses the pipe between a ``FactStore`` and its writer process (msgpack, length-prefixed frames).

Store side: ``encode_item(item)`` turns one buffered item (a router ``Record``
or a ``Fact``) into msgpack bytes without validating it (validation is the
writer's job) and never raises: an item that cannot be encoded becomes an
``Invalid`` entry carrying the reason, which the writer counts as rejected.
Lazy candidates are cheap on the routing thread: the router's ``WorkerRoute``
travels as the inputs of ``candidates.make_candidate`` (an ext type, a few
dozen bytes plus its heartbeat) and is materialized in the writer; any other
object with a ``best`` attribute is materialized here. Each ``Heartbeat``
object is encoded once (the router shares one across all routes of its worker
until the next heartbeat arrives): a bounded cache by identity, which holds
the object so that its ``id`` is not reused while cached; the writer decodes
each distinct heartbeat once. A decision record carries
only the fields the store keeps (``records.DecisionData``): the router's
``pruned`` map, for one, is not sent.
``batch_frame(items)`` frames a list of encoded items without re-encoding them
(the payload starts with the item count, so a writer accounts for every item
even if a payload failed to decode).

Writer side: ``decode_items(payload)`` returns the items of one frame, each a
``Record``, a ``Fact`` or an ``Invalid``; a lazy route decodes to an object
whose ``best`` builds the candidate (raising on bad input, which
``records.to_writes`` reports as a malformed record).

Both directions use ``frame(payload)`` (a 4-byte little-endian length, then the
payload) and ``FrameBuffer``, which cuts a byte stream back into payloads.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import msgspec

from kvrelay.core.planning.candidates import WorkerRoute
from kvrelay.core.planning.predicted_ttft import Candidate, Scoring, make_candidate
from kvrelay.core.planning.routes import Boundary
from kvrelay.core.router.events import Record
from kvrelay.facts.records import DecisionData, Fact
from kvrelay.protocol.messages import Heartbeat, RouteSegment

ROUTE_EXT = 1
"""msgpack ext code of a lazy ``WorkerRoute``."""

_LENGTH = struct.Struct("<I")
MAX_FRAME_BYTES = 1 << 30


@dataclass(frozen=True, slots=True)
class Invalid:
    """An item the store could not send as it was: the writer rejects it with ``message``."""

    message: str


RouteInputs = tuple[msgspec.Raw, float, float, tuple[RouteSegment, ...], Boundary, int, int, Scoring]
"""``WorkerRoute.best_inputs`` as the writer decodes them: the heartbeat stays its msgpack bytes."""

HEARTBEATS_CACHED = 4096
"""Bound of each side's heartbeat cache (encoded by object, decoded by bytes); a full cache starts over."""

DECISION_FIELDS = frozenset(DecisionData.__struct_fields__)

_route_encoder = msgspec.msgpack.Encoder()
_route_decoder: msgspec.msgpack.Decoder[RouteInputs] = msgspec.msgpack.Decoder(RouteInputs)
_heartbeat_decoder = msgspec.msgpack.Decoder(Heartbeat)
_encoded_heartbeats: dict[int, tuple[Heartbeat, msgspec.Raw]] = {}
_decoded_heartbeats: dict[bytes, Heartbeat] = {}


def _heartbeat_bytes(heartbeat: Heartbeat) -> msgspec.Raw:
    hit = _encoded_heartbeats.get(id(heartbeat))
    if hit is not None and hit[0] is heartbeat:
        return hit[1]
    if len(_encoded_heartbeats) >= HEARTBEATS_CACHED:
        _encoded_heartbeats.clear()
    raw = msgspec.Raw(_route_encoder.encode(heartbeat))
    _encoded_heartbeats[id(heartbeat)] = (heartbeat, raw)
    return raw


def _heartbeat_of(raw: msgspec.Raw) -> Heartbeat:
    data = bytes(raw)
    heartbeat = _decoded_heartbeats.get(data)
    if heartbeat is None:
        if len(_decoded_heartbeats) >= HEARTBEATS_CACHED:
            _decoded_heartbeats.clear()
        heartbeat = _decoded_heartbeats[data] = _heartbeat_decoder.decode(data)
    return heartbeat


def _enc_hook(obj: Any) -> Any:
    if type(obj) is WorkerRoute:
        inputs = obj.best_inputs()
        return msgspec.msgpack.Ext(ROUTE_EXT, _route_encoder.encode((_heartbeat_bytes(inputs[0]), *inputs[1:])))
    best = getattr(obj, "best", None)
    if best is not None:
        return best
    raise NotImplementedError(f"a {type(obj).__name__} cannot be stored")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def _describe(item: Any) -> str:
    if isinstance(item, Record):
        return f"{item.kind} record ({item.request_id!r}, attempt {item.attempt!r})"
    if isinstance(item, Fact):
        return f"{item.kind} fact"
    return f"a {type(item).__name__}"


def encode_item(item: Any) -> bytes:
    """One item as msgpack bytes; an item that cannot be encoded becomes an ``Invalid`` naming the reason."""
    try:
        if isinstance(item, Record):
            data = item.data
            if item.kind == "decision" and isinstance(data, dict):
                data = {name: value for name, value in data.items() if name in DECISION_FIELDS}
            return _encoder.encode(("r", item.kind, item.request_id, item.attempt, item.now, data))
        if isinstance(item, Fact):
            return _encoder.encode(("f", item.kind, item.params))
        message = f"expected a kvrelay.core.router.events.Record, got {type(item).__name__}"
    except Exception as exc:
        message = f"{_describe(item)}: cannot be sent to the fact writer: {exc!r}"
    return _encoder.encode(("x", message))


def batch_frame(items: list[bytes]) -> bytes:
    """A frame whose payload is the item count, then the msgpack array of already encoded ``items``."""
    n = len(items)
    if n < 16:
        head = bytes((0x90 | n,))
    elif n < 1 << 16:
        head = b"\xdc" + n.to_bytes(2, "big")
    else:
        head = b"\xdd" + n.to_bytes(4, "big")
    payload = _LENGTH.pack(n) + head + b"".join(items)
    return _LENGTH.pack(len(payload)) + payload


def frame(payload: bytes) -> bytes:
    return _LENGTH.pack(len(payload)) + payload


class FrameBuffer:
    """Accumulates bytes read from a stream and yields the complete frames' payloads, in order."""

    def __init__(self) -> None:
        self._data = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._data += data
        out: list[bytes] = []
        start = 0
        buf = self._data
        while len(buf) - start >= _LENGTH.size:
            (size,) = _LENGTH.unpack_from(buf, start)
            if size > MAX_FRAME_BYTES:
                raise ValueError(f"fact writer frame of {size} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
            end = start + _LENGTH.size + size
            if end > len(buf):
                break
            out.append(bytes(buf[start + _LENGTH.size : end]))
            start = end
        del buf[:start]
        return out


class LazyRoute:
    """A decoded ``WorkerRoute``: ``best`` builds its candidate (raising if the inputs are malformed)."""

    __slots__ = ("_data",)

    def __init__(self, data: bytes) -> None:
        self._data = data

    @property
    def best(self) -> Candidate:
        heartbeat, base_queue, lower_load, segments, boundary, prompt_len, chunk_tokens, scoring = (
            _route_decoder.decode(self._data)
        )
        return make_candidate(
            _heartbeat_of(heartbeat), base_queue, lower_load, segments, boundary, prompt_len, chunk_tokens, scoring
        )


def _ext_hook(code: int, data: memoryview) -> Any:
    if code == ROUTE_EXT:
        return LazyRoute(bytes(data))
    return Invalid(f"unknown msgpack ext type {code}")


_decoder = msgspec.msgpack.Decoder(ext_hook=_ext_hook)


def decode_items(payload: bytes) -> list[Record | Fact | Invalid]:
    """The items of one batch frame's payload (see the module docstring); as many as it says it holds."""
    (count,) = _LENGTH.unpack_from(payload)
    try:
        out: list[Record | Fact | Invalid] = []
        for entry in _decoder.decode(memoryview(payload)[_LENGTH.size :]):
            tag = entry[0]
            if tag == "r":
                out.append(Record(entry[1], entry[2], entry[3], entry[4], entry[5]))
            elif tag == "f":
                out.append(Fact(entry[1], entry[2]))
            else:
                out.append(Invalid(str(entry[1])))
        if len(out) == count:
            return out
        reason = f"it holds {len(out)} items, not {count}"
    except Exception as exc:
        reason = repr(exc)
    return [Invalid(f"a batch of {count} items could not be decoded: {reason}")] * count
