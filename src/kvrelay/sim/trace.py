"""Mooncake-format traces: loading, the infinite-cache bound, and request synthesis.

Format (one JSON object per line, as published by kvcache-ai/Mooncake in
``FAST25-release/traces``)::

    {"timestamp": ms, "input_length": int, "output_length": int, "hash_ids": [int, ...]}

``hash_ids`` are prefix-chained block ids of ``block_tokens`` tokens each, so two
requests share a cached prefix of k blocks exactly when their first k ids are
equal, and ``len(hash_ids) == ceil(input_length / block_tokens)``.

The trace carries no tokens. ``PromptSynthesizer`` makes a deterministic prompt
from the block ids (the tokens of a block are a function of its id and offset,
and distinct ids give distinct tokens) and the request's chunk chain with the
real key rule of docs/design.md section 4 (``protocol.chunk_keys`` over those
tokens), so the chain the router receives is the chain it would derive from the
prompt itself.

Two bounds on what any routing can serve from cache, both with an infinite
cache and perfect global routing: ``infinite_cache_bound`` counts whole blocks
(the figure trace papers quote), ``chunk_cache_bound`` counts what a kvrelay
cluster can actually reuse: full chunks of a prompt's routable chain
(``chunk_keys.cacheable_chunks``) whose block-id prefix and offset an earlier
request held. A simulated policy's prefix-hit share can never exceed the
chunk-level bound.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from kvrelay.core.router.events import Request
from kvrelay.protocol.chunk_keys import DIGEST_BYTES, cacheable_chunks, root_key
from kvrelay.protocol.messages import Sampling

DEFAULT_BLOCK_TOKENS = 512
SYNTHETIC_VOCAB = 128_000
"""Token ids of synthesized prompts are below this (a Llama-3-class vocabulary)."""
ID_TOKENS = 4
"""A synthesized block opens with its id in this many base-``SYNTHETIC_VOCAB`` digits (zigzag-coded), so
distinct ids give distinct blocks: 128,000**4 > 2**67 covers every 64-bit id."""
_ID_LIMIT = 1 << 63

_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceError(ValueError):
    """A trace file that is not in the Mooncake format; the message names the line."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One line of a trace. ``line`` is 1-based in the file."""

    line: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CacheBound:
    """Prefix hits with an infinite cache and perfect global routing, counted in ``units`` (blocks or chunks)."""

    units: int
    hit_units: int
    tokens: int
    hit_tokens: int

    @property
    def unit_share(self) -> float:
        return self.hit_units / self.units if self.units else 0.0

    @property
    def token_share(self) -> float:
        return self.hit_tokens / self.tokens if self.tokens else 0.0


def _nonneg_int(obj: dict, name: str, where: str) -> int:
    value = obj[name]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TraceError(f"{where}: {name!r} must be a non-negative integer, got {value!r}")
    return value


def parse_trace_line(text: str, line: int, block_tokens: int, source: str = "trace") -> TraceRequest:
    """Parse and validate one line; raise ``TraceError`` naming ``source:line`` and the fix."""
    where = f"{source}:{line}"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not a JSON object ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object with fields {', '.join(_FIELDS)}")
    missing = [f for f in _FIELDS if f not in obj]
    if missing:
        raise TraceError(
            f"{where}: missing field(s) {', '.join(missing)}; a Mooncake trace line has {', '.join(_FIELDS)}"
        )
    ts = obj["timestamp"]
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or ts < 0 or not math.isfinite(ts):
        raise TraceError(f"{where}: 'timestamp' must be non-negative milliseconds, got {ts!r}")
    input_length = _nonneg_int(obj, "input_length", where)
    output_length = _nonneg_int(obj, "output_length", where)
    if input_length < 1 or output_length < 1:
        raise TraceError(f"{where}: input_length and output_length must be at least 1")
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and -_ID_LIMIT <= h < _ID_LIMIT for h in ids
    ):
        raise TraceError(f"{where}: 'hash_ids' must be a list of 64-bit integers")
    expected = math.ceil(input_length / block_tokens)
    if len(ids) != expected:
        raise TraceError(
            f"{where}: {len(ids)} hash_ids but input_length {input_length} at {block_tokens} tokens per block "
            f"needs {expected}; pass the trace's block size with --block-tokens"
        )
    return TraceRequest(line, float(ts), input_length, output_length, tuple(ids))


def load_trace(
    path: str | Path,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    limit: int | None = None,
) -> list[TraceRequest]:
    """The first ``limit`` requests of a trace file (blank lines skipped), ordered by timestamp (stable)."""
    if block_tokens < 1:
        raise TraceError(f"block size must be positive, got {block_tokens}")
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"trace file {str(p)!r} does not exist")
    out: list[TraceRequest] = []
    with p.open(encoding="utf-8") as f:
        for number, text in enumerate(f, start=1):
            if limit is not None and len(out) >= limit:
                break
            if text.strip():
                out.append(parse_trace_line(text, number, block_tokens, p.name))
    if not out:
        raise TraceError(f"trace file {str(p)!r} holds no requests")
    out.sort(key=lambda r: r.timestamp_ms)
    return out


def trace_slice(requests: Sequence[TraceRequest], offset: int, count: int) -> list[TraceRequest]:
    """Requests ``offset`` to ``offset + count - 1`` of a trace (timestamp order); ``TraceError`` naming the
    largest offset that fits where the trace holds fewer."""
    if offset < 0 or count < 1:
        raise TraceError(f"--offset {offset} --count {count}: the offset must be at least 0 and the count 1")
    if offset + count > len(requests):
        fits = f"use --offset {len(requests) - count} or less" if count <= len(requests) else "use a smaller --count"
        raise TraceError(f"--offset {offset} --count {count} reaches past the trace's {len(requests)} requests: {fits}")
    return list(requests[offset : offset + count])


def jitter_arrivals(requests: Iterable[TraceRequest], jitter_ms: float, seed: int) -> list[TraceRequest]:
    """``requests`` with each timestamp moved by a uniform draw from ``[-jitter_ms, jitter_ms]`` (clamped at 0),
    ordered by the new timestamps (stable); the draws come from ``random.Random(seed)`` in trace order.

    A saturated replay is chaotic: one request routed differently changes every later queue, so a figure
    of one replay can differ between two policies by more than their routing does. Replays of slightly
    moved arrivals give the spread of each figure (``bench/sim_spread.py``). ``jitter_ms`` 0 returns the
    requests unchanged.
    """
    if not jitter_ms >= 0.0 or math.isinf(jitter_ms):
        raise ValueError(f"arrival jitter must be a finite number of milliseconds >= 0, got {jitter_ms}")
    if jitter_ms == 0.0:
        return list(requests)
    rng = random.Random(seed)
    moved = [replace(r, timestamp_ms=max(0.0, r.timestamp_ms + rng.uniform(-jitter_ms, jitter_ms))) for r in requests]
    moved.sort(key=lambda r: r.timestamp_ms)
    return moved


def infinite_cache_bound(requests: Iterable[TraceRequest], block_tokens: int) -> CacheBound:
    """Blocks (and their tokens) whose id, hence whole prefix, appeared in an earlier request (units: blocks)."""
    seen: set[int] = set()
    blocks = hit_blocks = tokens = hit_tokens = 0
    for r in requests:
        last = len(r.hash_ids) - 1
        for i, h in enumerate(r.hash_ids):
            n = block_tokens if i < last else r.input_length - block_tokens * last
            blocks += 1
            tokens += n
            if h in seen:
                hit_blocks += 1
                hit_tokens += n
        seen.update(r.hash_ids)
    return CacheBound(blocks, hit_blocks, tokens, hit_tokens)


def chunk_cache_bound(requests: Iterable[TraceRequest], block_tokens: int, chunk_tokens: int) -> CacheBound:
    """Routable chunks (units: chunks; tokens: all prompt tokens) that an earlier request's chain held.

    Chunk ``j`` of a request is the same content as in an earlier request exactly
    when both have the same block ids up to its block and both chains reach ``j``
    (a chain holds ``cacheable_chunks(input_length)`` chunks: the last prompt token
    is always computed). Block-id prefixes are interned, so this is exact even
    for a trace whose ids are not prefix-chained.
    """
    if block_tokens % chunk_tokens:
        raise TraceError(f"block size {block_tokens} is not a multiple of chunk_tokens {chunk_tokens}")
    per_block = block_tokens // chunk_tokens
    prefixes: dict[tuple[int, int], int] = {}
    seen: set[tuple[int, int]] = set()
    chunks = hit_chunks = tokens = 0
    for r in requests:
        n = cacheable_chunks(r.input_length, chunk_tokens)
        tokens += r.input_length
        chunks += n
        node = -1
        for j in range(n):
            if j % per_block == 0:
                block = r.hash_ids[j // per_block]
                node = prefixes.setdefault((node, block), len(prefixes))
            key = (node, j % per_block)
            if key in seen:
                hit_chunks += 1
            else:
                seen.add(key)
    return CacheBound(chunks, hit_chunks, tokens, hit_chunks * chunk_tokens)


class PromptSynthesizer:
    """Deterministic prompts and chunk chains for trace requests.

    Block ``h`` holds tokens ``(h * 2654435761 + i * 40503 + 7) % SYNTHETIC_VOCAB``
    for offsets ``i >= ID_TOKENS`` and the digits of ``h`` before them, so distinct
    ids give distinct blocks (a block is at least one chunk, so the first chunk of
    a block already tells ids apart). Chunk keys follow ``protocol.chunk_keys``
    over those tokens, memoized per (parent key, block id), which is exact
    whatever the trace.
    """

    def __init__(self, fingerprint: bytes, block_tokens: int, chunk_tokens: int) -> None:
        if block_tokens % chunk_tokens:
            raise TraceError(f"block size {block_tokens} is not a multiple of chunk_tokens {chunk_tokens}")
        if block_tokens < ID_TOKENS:
            raise TraceError(f"block size {block_tokens} is below the {ID_TOKENS} tokens that name a block")
        self.block_tokens = block_tokens
        self.chunk_tokens = chunk_tokens
        self.root = root_key(fingerprint)
        self._offsets = np.arange(block_tokens, dtype=np.int64) * 40503 + 7
        self._keys: dict[tuple[bytes, int], tuple[bytes, ...]] = {}

    def block_tokens_of(self, block_id: int) -> np.ndarray:
        """The synthesized tokens of one full block: its id's digits, then tokens mixed from id and offset."""
        tokens = (self._offsets + (block_id % SYNTHETIC_VOCAB) * (2654435761 % SYNTHETIC_VOCAB)) % SYNTHETIC_VOCAB
        code = (block_id << 1) ^ (block_id >> 63)  # zigzag: every 64-bit id to a distinct non-negative int
        for i in range(ID_TOKENS):
            code, tokens[i] = divmod(code, SYNTHETIC_VOCAB)
        return tokens

    def _block_keys(self, parent: bytes, block_id: int) -> tuple[bytes, ...]:
        memo = self._keys.get((parent, block_id))
        if memo is None:
            raw = self.block_tokens_of(block_id).astype("<u4").tobytes()
            width = 4 * self.chunk_tokens
            keys: list[bytes] = []
            key = parent
            for start in range(0, len(raw), width):
                h = hashlib.blake2b(key, digest_size=DIGEST_BYTES)
                h.update(raw[start : start + width])
                key = h.digest()
                keys.append(key)
            memo = self._keys[(parent, block_id)] = tuple(keys)
        return memo

    def prompt(self, r: TraceRequest) -> tuple[int, ...]:
        """The synthesized prompt of ``r``: ``input_length`` tokens."""
        parts = np.concatenate([self.block_tokens_of(h) for h in r.hash_ids])[: r.input_length]
        return tuple(parts.tolist())

    def chain(self, r: TraceRequest) -> tuple[bytes, ...]:
        """The routable chunk chain of ``r`` (its cacheable full chunks)."""
        n = cacheable_chunks(r.input_length, self.chunk_tokens)
        keys: list[bytes] = []
        parent = self.root
        for h in r.hash_ids:
            if len(keys) >= n:
                break
            block = self._block_keys(parent, h)
            keys.extend(block)
            parent = block[-1]
        return tuple(keys[:n])

    def request(self, r: TraceRequest, request_id: str, model: str) -> Request:
        """The request ingress would submit for ``r``; its sampling seed is the trace line number."""
        return Request(
            request_id=request_id,
            model=model,
            prompt=self.prompt(r),
            max_new_tokens=r.output_length,
            sampling=Sampling(seed=r.line),
            chain=self.chain(r),
        )
