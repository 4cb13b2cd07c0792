"""Chunk files: the ``ssd`` tier (a local directory, bounded, LRU) and a shared-directory ``object`` tier.

One chunk per file, named ``<key hex>.kvc``. Writes are atomic: the bytes go to a
temporary file in the same directory (``.<key hex>.<random>.tmp``), are fsynced,
and the file is renamed onto its final name with ``os.replace`` (then the
directory is fsynced). A writer killed at any point leaves at most a temporary
file, which no reader opens; ``SsdTier`` deletes leftovers when it starts.
Reads map the file (``mmap``, read-only) and verify it in place. A write the file
system refuses (a full disk) stores nothing and raises nothing: ``put`` returns
False and counts an error.
"""

from __future__ import annotations

import logging
import mmap
import os
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

from kvrelay.protocol.chunk_keys import DIGEST_BYTES
from kvrelay.store.chunk_format import ChunkView, decode_whole_header
from kvrelay.store.tier import (
    ChunkTier,
    CorruptionListener,
    Counters,
    LruIndex,
    ResidencyListener,
)

log = logging.getLogger(__name__)

CHUNK_SUFFIX = ".kvc"
TMP_SUFFIX = ".tmp"
WRITE_PIECE_BYTES = 1 << 20


def chunk_file_name(key: bytes) -> str:
    return key.hex() + CHUNK_SUFFIX


def key_of_file_name(name: str) -> bytes | None:
    """The key a chunk file name stands for, or None for any other name."""
    stem = name.removesuffix(CHUNK_SUFFIX)
    if stem == name or len(stem) != 2 * DIGEST_BYTES:
        return None
    try:
        return bytes.fromhex(stem)
    except ValueError:
        return None


def _write_all(fd: int, data: memoryview) -> None:
    """Write all of ``data`` to ``fd`` in pieces of at most ``WRITE_PIECE_BYTES``."""
    pos = 0
    while pos < data.nbytes:
        pos += os.write(fd, data[pos : pos + WRITE_PIECE_BYTES])


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_or_refuse(tier: str, counters: Counters, directory: Path, key: bytes, blob: Any, fsync: bool) -> bool:
    """``write_chunk_file``, or False when the file system refuses it (full, read-only, failing): logged and
    counted in ``counters.errors``, so a full disk costs this copy only, never the write through the other tiers
    or a restore that was going to read the chunk back."""
    try:
        write_chunk_file(directory, key, blob, fsync)
    except OSError as exc:
        counters.add(errors=1)
        log.warning("the %s tier cannot write chunk %s into %s: %s; not stored", tier, key.hex(), directory, exc)
        return False
    return True


def write_chunk_file(directory: Path, key: bytes, blob: Any, fsync: bool = True) -> Path:
    """Atomically make ``directory/<key>.kvc`` hold ``blob``; a concurrent writer of the same key is harmless."""
    final = directory / chunk_file_name(key)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{key.hex()}.", suffix=TMP_SUFFIX)
    try:
        _write_all(fd, memoryview(blob).cast("B"))
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, final)
    if fsync:
        _fsync_dir(directory)
    return final


_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def map_chunk_file(path: Path) -> Any:
    """A read-only mapping of ``path`` (``b""`` for an empty file), or None when it does not exist.

    ``MAP_POPULATE`` (Linux) maps the file's cached pages in one call instead of
    one page fault per 4 KiB page. Chunk files are never written in place (a new
    version is a new inode), so the mapping stays the verified bytes.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        size = os.fstat(fd).st_size
        return mmap.mmap(fd, size, flags=_MAP_FLAGS, prot=mmap.PROT_READ) if size else b""
    finally:
        os.close(fd)


class SsdTier(ChunkTier):
    """A local directory of chunk files holding at most ``capacity_bytes``, least recently used evicted first.

    This process owns the directory: its in-memory index is authoritative. At
    start it deletes leftover temporary files and adopts the chunk files it
    finds (oldest modification first, evicting beyond capacity), reporting them
    with reason ``recovered``. Up to ``open_maps`` recently read files stay
    mapped (chunk files are immutable, so a mapping stays valid until the key
    leaves the tier); every read still verifies the mapped bytes.
    """

    name = "ssd"
    durable = True

    def __init__(
        self,
        directory: str | os.PathLike[str],
        capacity_bytes: int,
        on_residency: ResidencyListener | None = None,
        on_corrupt: CorruptionListener | None = None,
        verify_payload: bool = True,
        fsync: bool = True,
        open_maps: int = 256,
    ) -> None:
        super().__init__(on_residency, on_corrupt, verify_payload)
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._index = LruIndex(capacity_bytes)
        self._fsync = fsync
        self._maps: OrderedDict[bytes, Any] = OrderedDict()
        self._open_maps = open_maps
        self._recover()

    def _recover(self) -> None:
        found: list[tuple[float, bytes, int]] = []
        with os.scandir(self.directory) as entries:
            for entry in entries:
                if entry.name.startswith(".") and entry.name.endswith(TMP_SUFFIX):
                    os.unlink(entry.path)
                elif (key := key_of_file_name(entry.name)) is not None:
                    stat = entry.stat()
                    found.append((stat.st_mtime, key, stat.st_size))
        with self._lock:
            adopted: list[bytes] = []
            for _, key, size in sorted(found):
                if not self._index.fits(size):
                    self.path_for(key).unlink(missing_ok=True)
                    continue
                for victim in self._index.admit(key, size):
                    self.path_for(victim).unlink(missing_ok=True)
                    adopted.remove(victim)
                adopted.append(key)
            self._emit(adopted, (), "recovered")

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._index.used_bytes

    def path_for(self, key: bytes) -> Path:
        return self.directory / chunk_file_name(key)

    def put(self, blob: Any) -> bool:
        key = decode_whole_header(blob).key
        size = memoryview(blob).nbytes
        with self._lock:
            if key in self._index:
                self._index.touch(key)
                return False
            if not self._index.fits(size):
                return False
        if not write_or_refuse(self.name, self._counters, self.directory, key, blob, self._fsync):
            return False
        with self._lock:
            self._counters.add(bytes_written=size, chunks_written=1)
            if key in self._index:
                return False
            victims = self._index.admit(key, size)
            for victim in victims:
                self._maps.pop(victim, None)
                self.path_for(victim).unlink(missing_ok=True)
            self._counters.add(evictions=len(victims))
            self._emit((), victims, "evicted")
            self._emit((key,), (), "stored")
            return True

    def get(self, key: bytes, fingerprint: bytes | None = None) -> ChunkView | None:
        with self._lock:
            if key not in self._index:
                self._counters.add(misses=1)
                return None
            self._index.touch(key)
            buffer = self._maps.get(key)
            if buffer is not None:
                self._maps.move_to_end(key)
        if buffer is None:
            buffer = map_chunk_file(self.path_for(key))
            if buffer is not None and self._open_maps > 0:
                with self._lock:
                    if key in self._index:
                        self._maps[key] = buffer
                        while len(self._maps) > self._open_maps:
                            self._maps.popitem(last=False)
        if buffer is None:
            with self._lock:
                self._counters.add(misses=1)
                if self._index.pop(key) is not None:
                    self._emit((), (key,), "removed")
            return None
        return self._served(buffer, key, fingerprint)

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    def keys(self) -> list[bytes]:
        with self._lock:
            return self._index.keys()

    def _delete(self, key: bytes) -> bool:
        self._maps.pop(key, None)
        if self._index.pop(key) is None:
            return False
        self.path_for(key).unlink(missing_ok=True)
        return True


class SharedDirTier(ChunkTier):
    """The ``object`` tier on a directory shared by every worker (a shared file system).

    Unbounded and not owned: other processes add and remove files, so every
    call asks the file system. Temporary files are left alone (another writer
    may still be writing them).
    """

    name = "object"
    durable = True

    def __init__(
        self,
        directory: str | os.PathLike[str],
        on_residency: ResidencyListener | None = None,
        on_corrupt: CorruptionListener | None = None,
        verify_payload: bool = True,
        fsync: bool = True,
    ) -> None:
        super().__init__(on_residency, on_corrupt, verify_payload)
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._fsync = fsync

    def path_for(self, key: bytes) -> Path:
        return self.directory / chunk_file_name(key)

    def put(self, blob: Any) -> bool:
        key = decode_whole_header(blob).key
        if self.path_for(key).exists():
            return False
        if not write_or_refuse(self.name, self._counters, self.directory, key, blob, self._fsync):
            return False
        size = memoryview(blob).nbytes
        with self._lock:
            self._counters.add(bytes_written=size, chunks_written=1)
            self._emit((key,), (), "stored")
        return True

    def get(self, key: bytes, fingerprint: bytes | None = None) -> ChunkView | None:
        buffer = map_chunk_file(self.path_for(key))
        if buffer is None:
            self._counters.add(misses=1)
            return None
        return self._served(buffer, key, fingerprint)

    def contains(self, key: bytes) -> bool:
        return self.path_for(key).exists()

    def keys(self) -> list[bytes]:
        with os.scandir(self.directory) as entries:
            return [key for entry in entries if (key := key_of_file_name(entry.name)) is not None]

    def _delete(self, key: bytes) -> bool:
        try:
            self.path_for(key).unlink()
        except FileNotFoundError:
            return False
        return True
