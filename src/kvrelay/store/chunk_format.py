"""The stored form of one KV chunk (docs/design.md section 4) and its verification.

Layout, little-endian, the payload starting at a 64-byte boundary so it can be
viewed in place (``torch.frombuffer`` on bytes or an ``mmap``)::

    fixed part  magic b"KVRC" | version u16 | header_len u16 | key 16s
                | payload_len u64 | payload_digest 16s | fp_len u16
                | dtype_len u8 | ndim u8
    variable    fingerprint (fp_len bytes) | dtype name (ascii) | shape (ndim x u64)
    padding     zero bytes up to header_len - 16
    header_digest 16s   blake2b-16 of header[: header_len - 16]
    payload     payload_len raw bytes (the KV of one chunk for all layers)

``payload_digest`` is the 128-bit XXH3 of the payload (``payload_digest``
below). It is an integrity check against bit rot, truncation and torn copies,
not a content address: the chunk's key, a blake2b chain over the model
fingerprint and the tokens, is that. Format version 1 used blake2b here too,
which capped restore throughput far below a memory copy; XXH3 runs at memory
speed (docs/performance.md, "Chunk payload digest"). The KV layout belongs to the
runtime; this module stores only the shape, the dtype name (a ``torch`` dtype
name such as ``bfloat16``) and the bytes. ``decode_chunk`` accepts a buffer only
when the header digest, the payload digest (unless told not to), the declared
sizes, the key and the fingerprint all hold; otherwise it raises
``ChunkCorrupt`` naming what failed.
"""

from __future__ import annotations

import hashlib
import math
import struct
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import xxhash

from kvrelay.protocol.chunk_keys import DIGEST_BYTES

if TYPE_CHECKING:
    import torch

MAGIC = b"KVRC"
FORMAT_VERSION = 2
PAYLOAD_ALIGN = 64
MAX_FINGERPRINT_BYTES = 4096
MAX_NDIM = 8

_FIXED = struct.Struct("<4sHH16sQ16sHBB")

DTYPE_ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}
"""Element sizes of the dtypes a chunk may hold, by ``torch`` dtype name."""


class ChunkCorrupt(ValueError):
    """A stored chunk failed verification; ``reason`` says which check failed."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class ChunkHeader:
    """The parsed header of a chunk; ``header_len`` is where the payload starts."""

    key: bytes
    fingerprint: bytes
    shape: tuple[int, ...]
    dtype: str
    payload_len: int
    payload_digest: bytes
    header_len: int

    @property
    def total_len(self) -> int:
        return self.header_len + self.payload_len


@dataclass(frozen=True)
class ChunkView:
    """A verified chunk over ``buffer`` (bytes, bytearray or mmap), viewed in place.

    ``payload`` is a memoryview of the KV bytes inside ``buffer``; nothing was copied.
    """

    header: ChunkHeader
    buffer: Any
    payload: memoryview

    @property
    def key(self) -> bytes:
        return self.header.key

    @property
    def nbytes(self) -> int:
        return self.header.total_len

    def tensor(self) -> torch.Tensor:
        """The payload as a tensor of the stored shape and dtype, sharing memory with ``buffer``.

        The tensor must be treated as read-only: copy from it, never write into it.
        """
        import torch

        dtype = getattr(torch, self.header.dtype)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            flat = (
                torch.frombuffer(self.payload, dtype=dtype) if self.header.payload_len else torch.empty(0, dtype=dtype)
            )
        return flat.view(self.header.shape)

    def copy_into(self, dest: torch.Tensor) -> None:
        """Copy the payload into ``dest`` (any device): same dtype and shape, else ``ValueError`` naming both."""
        src = self.tensor()
        if dest.dtype != src.dtype or tuple(dest.shape) != tuple(src.shape):
            raise ValueError(
                f"chunk {self.key.hex()} holds {tuple(src.shape)} {src.dtype}; "
                f"the destination is {tuple(dest.shape)} {dest.dtype}"
            )
        dest.copy_(src, non_blocking=dest.device.type != "cpu")


def digest(data: Any) -> bytes:
    """blake2b-16 of a bytes-like object (the header's digest)."""
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES).digest()


def payload_digest(data: Any) -> bytes:
    """XXH3-128 of a bytes-like object (the payload's integrity check), 16 bytes."""
    return xxhash.xxh3_128_digest(data)


def _check_layout(key: bytes, fingerprint: bytes, shape: tuple[int, ...], dtype: str) -> int:
    if len(key) != DIGEST_BYTES:
        raise ValueError(f"chunk key must be {DIGEST_BYTES} bytes, got {len(key)}")
    if len(fingerprint) > MAX_FINGERPRINT_BYTES:
        raise ValueError(f"model fingerprint is {len(fingerprint)} bytes; at most {MAX_FINGERPRINT_BYTES} are allowed")
    if dtype not in DTYPE_ITEMSIZE:
        raise ValueError(f"dtype {dtype!r} cannot be stored; storable dtypes: {', '.join(DTYPE_ITEMSIZE)}")
    if len(shape) > MAX_NDIM or any(d < 0 for d in shape):
        raise ValueError(f"shape {shape} must have at most {MAX_NDIM} non-negative dimensions")
    return math.prod(shape) * DTYPE_ITEMSIZE[dtype]


def _header_len(fingerprint: bytes, dtype: str, ndim: int) -> int:
    unpadded = _FIXED.size + len(fingerprint) + len(dtype) + 8 * ndim + DIGEST_BYTES
    return -(-unpadded // PAYLOAD_ALIGN) * PAYLOAD_ALIGN


def encode_header(key: bytes, fingerprint: bytes, shape: tuple[int, ...], dtype: str, payload: Any) -> bytes:
    """The header for ``payload`` (a bytes-like object of exactly shape x dtype bytes)."""
    shape = tuple(int(d) for d in shape)
    expected = _check_layout(key, fingerprint, shape, dtype)
    payload_len = memoryview(payload).nbytes
    if payload_len != expected:
        raise ValueError(f"payload is {payload_len} bytes but shape {shape} of {dtype} needs {expected}")
    header_len = _header_len(fingerprint, dtype, len(shape))
    dtype_bytes = dtype.encode("ascii")
    body = (
        _FIXED.pack(
            MAGIC,
            FORMAT_VERSION,
            header_len,
            key,
            payload_len,
            payload_digest(payload),
            len(fingerprint),
            len(dtype_bytes),
            len(shape),
        )
        + fingerprint
        + dtype_bytes
        + struct.pack(f"<{len(shape)}Q", *shape)
    )
    body += bytes(header_len - DIGEST_BYTES - len(body))
    return body + digest(body)


def encode_chunk(key: bytes, fingerprint: bytes, kv: torch.Tensor) -> bytearray:
    """The stored form of ``kv`` (any device, any layout): header then payload, one copy of the bytes."""
    import torch

    dtype = str(kv.dtype).removeprefix("torch.")
    shape = tuple(int(d) for d in kv.shape)
    nbytes = _check_layout(key, fingerprint, shape, dtype)
    header_len = _header_len(fingerprint, dtype, len(shape))
    out = bytearray(header_len + nbytes)
    payload = memoryview(out)[header_len:]
    if nbytes:
        torch.frombuffer(out, dtype=torch.uint8, offset=header_len).copy_(
            kv.detach().contiguous().view(-1).view(torch.uint8)
        )
    out[:header_len] = encode_header(key, fingerprint, shape, dtype, payload)
    return out


def encode_chunk_bytes(key: bytes, fingerprint: bytes, shape: tuple[int, ...], dtype: str, payload: Any) -> bytearray:
    """The stored form of raw KV bytes ``payload`` of ``shape`` and ``dtype``."""
    header = encode_header(key, fingerprint, shape, dtype, payload)
    out = bytearray(header)
    out += memoryview(payload).cast("B")
    return out


def decode_header(buffer: Any) -> ChunkHeader:
    """Parse and check the header at the start of ``buffer``; raises ``ChunkCorrupt``."""
    view = memoryview(buffer).cast("B")
    if view.nbytes < _FIXED.size:
        raise ChunkCorrupt(f"truncated header: {view.nbytes} bytes")
    magic, version, header_len, key, payload_len, payload_digest, fp_len, dtype_len, ndim = _FIXED.unpack_from(view)
    if magic != MAGIC:
        raise ChunkCorrupt(f"bad magic {bytes(magic)!r}")
    if version != FORMAT_VERSION:
        raise ChunkCorrupt(f"unsupported chunk format version {version} (this build reads {FORMAT_VERSION})")
    if header_len % PAYLOAD_ALIGN or header_len < _FIXED.size + DIGEST_BYTES or header_len > view.nbytes:
        raise ChunkCorrupt(f"bad header length {header_len}")
    if digest(view[: header_len - DIGEST_BYTES]) != bytes(view[header_len - DIGEST_BYTES : header_len]):
        raise ChunkCorrupt("header digest mismatch")
    pos = _FIXED.size
    fingerprint = bytes(view[pos : pos + fp_len])
    pos += fp_len
    dtype = bytes(view[pos : pos + dtype_len]).decode("ascii", errors="replace")
    pos += dtype_len
    shape = struct.unpack_from(f"<{ndim}Q", view, pos)
    if dtype not in DTYPE_ITEMSIZE:
        raise ChunkCorrupt(f"unknown dtype {dtype!r}")
    if math.prod(shape) * DTYPE_ITEMSIZE[dtype] != payload_len:
        raise ChunkCorrupt(f"shape {shape} of {dtype} does not match payload length {payload_len}")
    return ChunkHeader(bytes(key), fingerprint, tuple(shape), dtype, payload_len, bytes(payload_digest), header_len)


def decode_whole_header(blob: Any) -> ChunkHeader:
    """The header of a whole stored chunk ``blob`` whose length must match it; raises ``ChunkCorrupt``."""
    header = decode_header(blob)
    size = memoryview(blob).nbytes
    if size != header.total_len:
        raise ChunkCorrupt(f"chunk {header.key.hex()} is {size} bytes but its header declares {header.total_len}")
    return header


def decode_chunk(
    buffer: Any, key: bytes, fingerprint: bytes | None = None, *, verify_payload: bool = True
) -> ChunkView:
    """Verify ``buffer`` as the chunk ``key`` (of ``fingerprint`` when given) and view it in place.

    Raises ``ChunkCorrupt`` when any check fails; a returned view is safe to copy into pages.
    """
    header = decode_header(buffer)
    if header.key != key:
        raise ChunkCorrupt(f"key mismatch: asked {key.hex()}, header holds {header.key.hex()}")
    if fingerprint is not None and header.fingerprint != fingerprint:
        raise ChunkCorrupt("model fingerprint mismatch")
    view = memoryview(buffer).cast("B")
    if view.nbytes != header.total_len:
        raise ChunkCorrupt(f"length {view.nbytes} differs from the declared {header.total_len}")
    payload = view[header.header_len :]
    if verify_payload and payload_digest(payload) != header.payload_digest:
        raise ChunkCorrupt("payload digest mismatch")
    return ChunkView(header, buffer, payload)
