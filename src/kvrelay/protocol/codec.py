"""msgpack framing of wire messages.

``encode`` accepts only wire messages (``messages.WIRE_TYPES``); anything else,
or a message holding a local-only value (a tensor, a timer, a reservation
handle, a bytes payload over the bound), raises ``ProtocolError``.
``decode`` turns one frame back into a message or raises ``ProtocolError`` with
a message naming what was wrong: an oversized frame, bytes that are not
msgpack, an unknown ``type``, an unsupported version, a missing or mistyped
field. It never raises anything else.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvrelay.protocol.messages import PROTOCOL_VERSION, WIRE_TYPES, WireMessage

DEFAULT_MAX_FRAME_BYTES = 4 * 1024 * 1024
"""Control frames carry token ids and keys, never KV bytes: 4 MiB is generous."""


class ProtocolError(ValueError):
    """A frame or message that may not cross the wire, with the reason."""


_decoder = msgspec.msgpack.Decoder(WireMessage)


def _reject_local_only(obj: Any) -> Any:
    raise ProtocolError(f"{type(obj).__module__}.{type(obj).__qualname__} is local-only and never crosses the wire")


_encoder = msgspec.msgpack.Encoder(enc_hook=_reject_local_only)


def encode(message: WireMessage, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    """Encode one wire message as a msgpack frame of at most ``max_frame_bytes``."""
    if not isinstance(message, WIRE_TYPES):
        _reject_local_only(message)
    try:
        frame = _encoder.encode(message)
    except ProtocolError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"cannot encode {type(message).__name__}: {exc}") from None
    # Validate on the way out too: a message built with a wrong-typed field
    # (frozen structs do not check types at construction) must not leave.
    decode(frame, max_frame_bytes)
    return frame


def decode(frame: bytes, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> WireMessage:
    """Decode and validate one frame."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"a frame is bytes, got {type(frame).__name__}")
    if len(frame) > max_frame_bytes:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds the limit of {max_frame_bytes} bytes")
    try:
        message = _decoder.decode(frame)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"invalid message: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed frame: {exc}") from None
    if message.v != PROTOCOL_VERSION:
        raise ProtocolError(
            f"{type(message).__name__} has protocol version {message.v}; this build speaks {PROTOCOL_VERSION}"
        )
    return message
