"""The model fingerprint of docs/design.md section 4, and the weights digest it covers.

``model_fingerprint(weights_digest, config, kv_dtype, page_layout, chunk_tokens)``
is a 16-byte blake2b digest over a fixed byte layout (``FINGERPRINT_VERSION``,
then length-prefixed fields: the weights digest, the canonical JSON of
``config.to_dict()``, the KV dtype name, the page layout string, and
``chunk_tokens`` as uint32 little-endian). Equal inputs give equal bytes on any
host; changing any input changes the fingerprint.

``weights_digest(files)`` is a 16-byte blake2b digest of the weight files'
contents, in name order (file names themselves do not count): content-based,
so two hosts holding the same files agree. ``file_digest`` memoizes a file's
digest under ``memo_dir`` keyed by (absolute path, size, mtime_ns, inode), so an
unchanged large file is read once (what hashing costs: docs/performance.md,
"Weights digest").
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Sequence
from pathlib import Path

from kvrelay.models.config import ModelConfig
from kvrelay.protocol.chunk_keys import DEFAULT_PAGE_TOKENS

DIGEST_BYTES = 16
FINGERPRINT_VERSION = b"kvrelay-model-fingerprint-v1"
DEFAULT_PAGE_LAYOUT = f"page[layer][k|v][page_tokens={DEFAULT_PAGE_TOKENS}][kv_head][head_dim]"
_READ_BYTES = 1 << 22


def _field(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


def model_fingerprint(
    weights_digest: bytes, config: ModelConfig, kv_dtype: str, page_layout: str, chunk_tokens: int
) -> bytes:
    """The 16-byte fingerprint naming one model's KV byte content (see the module docstring)."""
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    config_json = json.dumps(config.to_dict(), sort_keys=True, separators=(",", ":")).encode()
    h = hashlib.blake2b(FINGERPRINT_VERSION, digest_size=DIGEST_BYTES)
    for part in (weights_digest, config_json, kv_dtype.encode(), page_layout.encode()):
        h.update(_field(part))
    h.update(struct.pack("<I", chunk_tokens))
    return h.digest()


def _hash_file(path: Path) -> bytes:
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    with path.open("rb") as f:
        while block := f.read(_READ_BYTES):
            h.update(block)
    return h.digest()


def file_digest(path: Path, memo_dir: Path | None = None, memo_min_bytes: int = 0) -> bytes:
    """blake2b-128 of ``path``'s bytes, memoized under ``memo_dir`` by path, size, mtime and inode.

    Files under ``memo_min_bytes`` (or every file, when ``memo_dir`` is None) are hashed each time.
    """
    stat = path.stat()
    if memo_dir is None or stat.st_size < memo_min_bytes:
        return _hash_file(path)
    identity = f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0{stat.st_ino}".encode()
    memo = memo_dir / hashlib.blake2b(identity, digest_size=DIGEST_BYTES).hexdigest()
    try:
        return bytes.fromhex(memo.read_text())
    except (OSError, ValueError):
        pass
    digest = _hash_file(path)
    memo_dir.mkdir(parents=True, exist_ok=True)
    partial = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
    partial.write_text(digest.hex())
    os.replace(partial, memo)
    return digest


def weights_digest(files: Sequence[Path], memo_dir: Path | None = None, memo_min_bytes: int = 0) -> bytes:
    """blake2b-128 over the content digests of ``files`` taken in name order (see ``file_digest``)."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for path in sorted(files, key=lambda p: p.name):
        h.update(file_digest(path, memo_dir, memo_min_bytes))
    return h.digest()
