"""vLLM's KV cache events, decoded and mapped to kvrelay chunk keys (pure; docs/design.md section 13).

vLLM (``vllm/distributed/kv_events.py``, 0.32) publishes on a ZMQ PUB socket
multipart frames ``(topic, seq as 8 bytes big-endian, payload)``; the payload
is msgpack of ``[ts, [event, ...], data_parallel_rank]`` where each event is a
map tagged by ``type``: ``BlockStored`` (``block_hashes``,
``parent_block_hash``, the blocks' ``token_ids`` concatenated, ``block_size``,
``medium``, ``lora_name``, ``extra_keys``, ``group_idx``, ``kv_cache_spec_kind``), ``BlockRemoved``
(``block_hashes``, ``group_idx``) or ``AllBlocksCleared``. A block hash is an int or bytes; one KV group's
blocks of the same tokens have the same hash as another's.

``BlockMirror`` follows one engine's blocks. A stored block's kvrelay key is
``chunk_key(parent key, its tokens)``, with the chain's root key for a block
without a parent, so with block size = chunk tokens the keys equal the
router's chain over the same token ids. A block whose parent the mirror does
not know (stored before the mirror started) is skipped: the router then
under-credits, never over-credits. Blocks of another medium than the device,
of a LoRA adapter, with extra hash keys (multimodal, cache salt), or of another
size are skipped too, and so are the blocks of a KV group that does not keep
every block of a prefix. A model with sliding-window layers (Gemma 3: five
groups of sliding-window layers, window 512, and one of full attention) has
vLLM store only the blocks near each prompt's end in its sliding-window groups,
so only a group of a ``PREFIX_KINDS`` kind can be followed from the chain's
root; the mirror learns each group's kind from its stored blocks and follows
those groups' stores and removals. Without kinds (older vLLM) it follows group
0. vLLM's own hit on such a model also needs the sliding-window blocks of the
last window before the hit's end, which vLLM keeps only at its checkpoints;
kvrelay's engines get one at every block (``launch.vllm_server``), so a cached
prefix is a hit at every block boundary unless vLLM evicted one of those blocks
first: the one way this mirror over-credits (docs/design.md section 13). The same hash stored twice is counted;
its key is removed only with its last copy.

``continuity(last_seq, seq)`` classifies a frame's sequence number: a gap means
events were lost, a sequence number that does not grow means the publisher
restarted; either way the mirror can no longer be trusted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import msgspec

from kvrelay.protocol.chunk_keys import chunk_key

BlockHash = int | bytes
DEVICE_MEDIUMS = (None, "GPU")
"""The ``medium`` values of blocks on the engine's device (its CPU build names them GPU too)."""
PREFIX_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
"""KV cache spec kinds (vLLM's ``KVCacheSpecKind``) whose group keeps every block of a cached prefix."""


class BlockStored(msgspec.Struct, tag=True, kw_only=True):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    token_ids: list[int]
    block_size: int
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, kw_only=True):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(EventBatch)


class KvEventError(ValueError):
    """A frame that is not a vLLM KV event batch."""


def decode_frame(parts: list[bytes]) -> tuple[int, EventBatch]:
    """``(seq, batch)`` of one multipart frame ``(topic, seq, payload)``; ``KvEventError`` if malformed."""
    if len(parts) != 3 or len(parts[1]) != 8:
        raise KvEventError(f"expected (topic, 8-byte seq, payload), got {len(parts)} parts")
    try:
        batch = _decoder.decode(parts[2])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise KvEventError(f"not a KV event batch: {exc}") from None
    return int.from_bytes(parts[1], "big", signed=True), batch


class Continuity(Enum):
    FIRST = "first"
    NEXT = "next"
    GAP = "gap"
    """Some batches were lost: removals the mirror did not see may have happened."""
    RESTARTED = "restarted"
    """The sequence went back: a new publisher, i.e. a restarted engine."""


def continuity(last_seq: int | None, seq: int) -> Continuity:
    """How frame ``seq`` follows the last one seen (None: none seen yet)."""
    if last_seq is None:
        return Continuity.FIRST
    if seq == last_seq + 1:
        return Continuity.NEXT
    return Continuity.GAP if seq > last_seq else Continuity.RESTARTED


@dataclass(frozen=True, slots=True)
class MirrorChange:
    """The net change of one batch: keys now held that were not, keys no longer held, and whether all cleared."""

    stored: tuple[bytes, ...] = ()
    removed: tuple[bytes, ...] = ()
    cleared: bool = False


@dataclass(slots=True)
class BlockMirror:
    """The engine's device blocks as kvrelay chunk keys (see the module docstring)."""

    root: bytes
    """The chain's root key: ``root_key`` of the engine's model fingerprint."""
    block_tokens: int
    held: dict[BlockHash, list[Any]] = field(default_factory=dict)
    """vLLM block hash -> [kvrelay key, copies]."""
    keys: dict[bytes, BlockHash] = field(default_factory=dict)
    """kvrelay key -> vLLM block hash, for the keys held."""
    skipped: int = 0
    """Blocks not mirrored (unknown parent, another medium, group, size, adapter or extra keys)."""
    group_kinds: dict[int, bool] = field(default_factory=dict)
    """Group index -> whether it keeps every block of a prefix, for the groups whose stored blocks named a kind."""

    def follows(self, group_idx: int | None) -> bool:
        """Whether the blocks of KV group ``group_idx`` are mirrored (see the module docstring)."""
        if group_idx is not None and group_idx in self.group_kinds:
            return self.group_kinds[group_idx]
        return group_idx in (None, 0)

    def clear(self) -> tuple[bytes, ...]:
        """Forget every block (not the groups' kinds: they are the engine's); the keys that were held."""
        gone = tuple(self.keys)
        self.held.clear()
        self.keys.clear()
        return gone


def apply_batch(mirror: BlockMirror, events: list[KvEvent]) -> MirrorChange:
    """Apply one batch's events in order to ``mirror``; return the net change of keys held."""
    before: dict[bytes, bool] = {}
    cleared = False
    for event in events:
        match event:
            case BlockStored():
                _store(mirror, event, before)
            case BlockRemoved():
                if event.medium in DEVICE_MEDIUMS and mirror.follows(event.group_idx):
                    for h in event.block_hashes:
                        _remove(mirror, h, before)
            case AllBlocksCleared():
                for key in list(mirror.keys):
                    before.setdefault(key, True)
                mirror.clear()
                cleared = True
    stored = tuple(k for k, was in before.items() if not was and k in mirror.keys)
    removed = tuple(k for k, was in before.items() if was and k not in mirror.keys)
    return MirrorChange(stored, removed, cleared)


def _store(mirror: BlockMirror, event: BlockStored, before: dict[bytes, bool]) -> None:
    n, size = len(event.block_hashes), mirror.block_tokens
    if event.group_idx is not None and event.kv_cache_spec_kind is not None:
        mirror.group_kinds[event.group_idx] = event.kv_cache_spec_kind in PREFIX_KINDS
    if (
        event.medium not in DEVICE_MEDIUMS
        or not mirror.follows(event.group_idx)
        or event.block_size != size
        or event.lora_name is not None
        or any(k is not None for k in event.extra_keys or ())
        or len(event.token_ids) < n * size
    ):
        mirror.skipped += n
        return
    if event.parent_block_hash is None:
        parent = mirror.root
    else:
        entry = mirror.held.get(event.parent_block_hash)
        if entry is None:
            mirror.skipped += n
            return
        parent = entry[0]
    for i, h in enumerate(event.block_hashes):
        entry = mirror.held.get(h)
        if entry is not None:
            entry[1] += 1
            parent = entry[0]
            continue
        key = chunk_key(parent, event.token_ids[i * size : (i + 1) * size])
        before.setdefault(key, key in mirror.keys)
        mirror.held[h] = [key, 1]
        mirror.keys[key] = h
        parent = key


def _remove(mirror: BlockMirror, h: BlockHash, before: dict[bytes, bool]) -> None:
    entry = mirror.held.get(h)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] > 0:
        return
    key = entry[0]
    del mirror.held[h]
    before.setdefault(key, True)
    if mirror.keys.get(key) == h:
        del mirror.keys[key]
