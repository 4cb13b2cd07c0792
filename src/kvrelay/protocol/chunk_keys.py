"""Content addresses of KV chunks (docs/design.md section 4).

``key_0 = H(model fingerprint)`` and ``key_i = H(key_{i-1} || tokens of chunk i
as uint32 little-endian)`` with H = blake2b, 16-byte digests. Only full chunks
are addressed. At most ``len(prompt) - 1`` tokens may come from cache, so the
routable chain of a prompt covers ``(len(prompt) - 1) // chunk_tokens`` chunks.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

DIGEST_BYTES = 16
DEFAULT_CHUNK_TOKENS = 64
"""Tokens per KV chunk when none is configured: the one default of router, workers, simulator and fingerprint."""
DEFAULT_PAGE_TOKENS = 16
"""Tokens per KV page when none is configured (a chunk is a whole number of pages)."""


def root_key(fingerprint: bytes) -> bytes:
    """``key_0``: the digest of the model fingerprint bytes."""
    return hashlib.blake2b(fingerprint, digest_size=DIGEST_BYTES).digest()


def _uint32_le(tokens: Sequence[int]) -> bytes:
    packed = array("I", tokens)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def chunk_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a chunk whose predecessor key is ``parent``."""
    h = hashlib.blake2b(parent, digest_size=DIGEST_BYTES)
    h.update(_uint32_le(tokens))
    return h.digest()


def cacheable_chunks(prompt_len: int, chunk_tokens: int) -> int:
    """How many full chunks of a prompt may come from cache (the last token is always computed)."""
    return max(prompt_len - 1, 0) // chunk_tokens


def chunk_chain(
    fingerprint: bytes, tokens: Sequence[int], chunk_tokens: int, chunks: int | None = None
) -> tuple[bytes, ...]:
    """Keys ``key_1 .. key_n`` of the first ``chunks`` full chunks of ``tokens`` (all full chunks by default)."""
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    n = len(tokens) // chunk_tokens if chunks is None else min(chunks, len(tokens) // chunk_tokens)
    keys: list[bytes] = []
    parent = root_key(fingerprint)
    for i in range(n):
        parent = chunk_key(parent, tokens[i * chunk_tokens : (i + 1) * chunk_tokens])
        keys.append(parent)
    return tuple(keys)


def prompt_chain(fingerprint: bytes, prompt: Sequence[int], chunk_tokens: int) -> tuple[bytes, ...]:
    """The routable chain of a prompt: its cacheable full chunks."""
    return chunk_chain(fingerprint, prompt, chunk_tokens, cacheable_chunks(len(prompt), chunk_tokens))
