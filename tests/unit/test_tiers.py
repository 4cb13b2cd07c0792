"""The ram, ssd and shared-directory tiers and the tier stack, on real memory and real files."""

from __future__ import annotations

import mmap
import threading
from pathlib import Path

import pytest
import torch

from kvrelay.protocol.chunk_keys import chunk_chain
from kvrelay.store.chunk_format import ChunkCorrupt, decode_header, encode_chunk
from kvrelay.store.files import SharedDirTier, SsdTier
from kvrelay.store.ram import RamTier
from kvrelay.store.tier import ChunkTier, CorruptChunk, ResidencyEvent
from kvrelay.store.tier_stack import TierStack

FP = b"tiny-llama|float32|64"
SHAPE = (2, 2, 8, 1, 8)
KEYS = chunk_chain(FP, list(range(64 * 8)), 64)


def chunk(i: int) -> bytearray:
    kv = torch.arange(i, i + 256, dtype=torch.float32).view(SHAPE)
    return encode_chunk(KEYS[i], FP, kv)


CHUNK_BYTES = len(chunk(0))


class Recorder:
    """Collects residency and corruption reports."""

    def __init__(self) -> None:
        self.events: list[ResidencyEvent] = []
        self.corrupt: list[CorruptChunk] = []

    def residency(self, event: ResidencyEvent) -> None:
        self.events.append(event)

    def corruption(self, report: CorruptChunk) -> None:
        self.corrupt.append(report)

    def by_reason(self, reason: str) -> list[bytes]:
        return [k for e in self.events if e.reason == reason for k in (e.stored + e.removed)]


def make_ram(tmp_path: Path, rec: Recorder, chunks: float = 100) -> RamTier:
    return RamTier(int(CHUNK_BYTES * chunks), rec.residency, rec.corruption)


def make_ssd(tmp_path: Path, rec: Recorder, chunks: float = 100) -> SsdTier:
    return SsdTier(tmp_path / "ssd", int(CHUNK_BYTES * chunks), rec.residency, rec.corruption, fsync=False)


def make_shared(tmp_path: Path, rec: Recorder, chunks: float = 100) -> SharedDirTier:
    return SharedDirTier(tmp_path / "shared", rec.residency, rec.corruption, fsync=False)


FACTORIES = {"ram": make_ram, "ssd": make_ssd, "shared": make_shared}


def flip_stored_byte(tier: ChunkTier, key: bytes, blob: bytearray, offset: int) -> None:
    """Flip one byte of the stored copy of ``key`` (in memory for ram, on disk for files)."""
    if isinstance(tier, RamTier):
        blob[offset] ^= 0x01
        return
    path = tier.path_for(key)  # type: ignore[attr-defined]
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(data)


@pytest.fixture(params=sorted(FACTORIES))
def tier_kind(request: pytest.FixtureRequest) -> str:
    return request.param


def test_put_get_contains_remove(tmp_path: Path, tier_kind: str) -> None:
    rec = Recorder()
    tier = FACTORIES[tier_kind](tmp_path, rec)
    blob = chunk(0)
    assert not tier.contains(KEYS[0])
    assert tier.get(KEYS[0], FP) is None
    assert tier.put(blob) is True
    assert tier.put(blob) is False
    assert tier.contains(KEYS[0])
    assert tier.keys() == [KEYS[0]]
    view = tier.get(KEYS[0], FP)
    assert view is not None and torch.equal(view.tensor(), torch.arange(0, 256, dtype=torch.float32).view(SHAPE))
    assert tier.remove(KEYS[0]) is True
    assert tier.remove(KEYS[0]) is False
    assert not tier.contains(KEYS[0]) and tier.get(KEYS[0], FP) is None
    counters = tier.counters()
    assert (counters.hits, counters.misses, counters.corrupt) == (1, 2, 0)
    assert counters.bytes_written == CHUNK_BYTES and counters.bytes_read == CHUNK_BYTES
    assert (counters.chunks_written, counters.removals) == (1, 1)
    assert [(e.tier, e.stored, e.removed, e.reason) for e in rec.events] == [
        (tier.name, (KEYS[0],), (), "stored"),
        (tier.name, (), (KEYS[0],), "removed"),
    ]
    assert all(e.durable == (tier_kind != "ram") for e in rec.events)


@pytest.mark.parametrize("part", ["payload", "header"])
def test_corrupt_chunk_is_detected_counted_removed_and_missed(tmp_path: Path, tier_kind: str, part: str) -> None:
    rec = Recorder()
    tier = FACTORIES[tier_kind](tmp_path, rec)
    blob = chunk(1)
    tier.put(blob)
    header_len = decode_header(blob).header_len
    flip_stored_byte(tier, KEYS[1], blob, header_len + 17 if part == "payload" else 40)
    assert tier.get(KEYS[1], FP) is None
    assert not tier.contains(KEYS[1])
    assert tier.counters().corrupt == 1 and tier.counters().hits == 0
    assert [(c.tier, c.key) for c in rec.corrupt] == [(tier.name, KEYS[1])]
    assert ("payload digest" in rec.corrupt[0].reason) == (part == "payload")
    assert rec.by_reason("corrupt") == [KEYS[1]]
    if tier_kind != "ram":
        assert not tier.path_for(KEYS[1]).exists()  # type: ignore[attr-defined]


def test_wrong_fingerprint_is_a_miss(tmp_path: Path, tier_kind: str) -> None:
    rec = Recorder()
    tier = FACTORIES[tier_kind](tmp_path, rec)
    tier.put(chunk(2))
    assert tier.get(KEYS[2], b"other model") is None
    assert rec.corrupt[0].reason == "model fingerprint mismatch"


@pytest.mark.parametrize("kind", ["ram", "ssd"])
def test_lru_bound_in_bytes(tmp_path: Path, kind: str) -> None:
    rec = Recorder()
    tier = FACTORIES[kind](tmp_path, rec, chunks=2.5)
    tier.put(chunk(0))
    tier.put(chunk(1))
    assert tier.get(KEYS[0], FP) is not None  # 0 is now more recent than 1
    tier.put(chunk(2))
    assert set(tier.keys()) == {KEYS[0], KEYS[2]}
    assert tier.used_bytes == 2 * CHUNK_BYTES  # type: ignore[attr-defined]
    assert rec.by_reason("evicted") == [KEYS[1]]
    assert tier.counters().evictions == 1
    if kind == "ssd":
        assert sorted(p.name for p in (tmp_path / "ssd").iterdir()) == sorted(
            k.hex() + ".kvc" for k in (KEYS[0], KEYS[2])
        )


@pytest.mark.parametrize("kind", ["ram", "ssd"])
def test_chunk_larger_than_capacity_is_not_stored(tmp_path: Path, kind: str) -> None:
    rec = Recorder()
    tier = FACTORIES[kind](tmp_path, rec, chunks=0.5)
    assert tier.put(chunk(0)) is False
    assert tier.keys() == [] and rec.events == []


def test_ssd_reads_through_mmap(tmp_path: Path) -> None:
    tier = make_ssd(tmp_path, Recorder())
    tier.put(chunk(3))
    view = tier.get(KEYS[3], FP)
    assert view is not None and isinstance(view.buffer, mmap.mmap)


def test_ssd_keeps_mappings_yet_verifies_every_read(tmp_path: Path) -> None:
    rec = Recorder()
    tier = make_ssd(tmp_path, rec)
    tier.put(chunk(4))
    first = tier.get(KEYS[4], FP)
    again = tier.get(KEYS[4], FP)
    assert first is not None and again is not None and again.buffer is first.buffer  # one mapping, kept
    path = tier.path_for(KEYS[4])
    with path.open("r+b") as f:  # the file changes under the kept mapping (a shared mapping sees it)
        f.seek(-3, 2)
        byte = f.read(1)
        f.seek(-3, 2)
        f.write(bytes([byte[0] ^ 0x01]))
    assert tier.get(KEYS[4], FP) is None
    assert tier.counters().corrupt == 1 and not tier.contains(KEYS[4]) and len(rec.corrupt) == 1


def test_ssd_recovers_its_directory_and_drops_temporary_files(tmp_path: Path) -> None:
    first = make_ssd(tmp_path, Recorder())
    for i in range(3):
        first.put(chunk(i))
    leftover = tmp_path / "ssd" / f".{KEYS[4].hex()}.abc.tmp"
    leftover.write_bytes(bytes(chunk(4))[:100])
    rec = Recorder()
    second = make_ssd(tmp_path, rec, chunks=2)
    assert not leftover.exists()
    assert len(second.keys()) == 2 and second.used_bytes == 2 * CHUNK_BYTES
    assert set(rec.by_reason("recovered")) == set(second.keys())
    assert all(second.get(k, FP) is not None for k in second.keys())
    assert len(list((tmp_path / "ssd").glob("*.kvc"))) == 2


def test_shared_dir_sees_chunks_written_by_another_process_view(tmp_path: Path) -> None:
    writer = make_shared(tmp_path, Recorder())
    reader = make_shared(tmp_path, Recorder())
    writer.put(chunk(5))
    assert reader.contains(KEYS[5]) and reader.keys() == [KEYS[5]]
    assert reader.get(KEYS[5], FP) is not None
    assert reader.put(chunk(5)) is False


def test_stack_writes_through_and_reads_fastest_first(tmp_path: Path) -> None:
    rec = Recorder()
    stack = TierStack(make_ram(tmp_path, rec), make_ssd(tmp_path, rec), make_shared(tmp_path, rec))
    assert stack.put(chunk(0)) == ("ram", "ssd", "object")
    assert stack.residency(KEYS[0]) == ("ram", "ssd", "object")
    hit = stack.get(KEYS[0], FP)
    assert hit is not None and hit.tier == "ram"
    stack.ram.remove(KEYS[0])  # type: ignore[union-attr]
    hit = stack.get(KEYS[0], FP)
    assert hit is not None and hit.tier == "ssd"
    assert [e.tier for e in rec.events if e.reason == "stored"] == ["ram", "ssd", "object"]


def test_stack_localizes_object_chunk_into_ssd_and_reads_it_mapped(tmp_path: Path) -> None:
    shared = make_shared(tmp_path, Recorder())
    shared.put(chunk(6))
    rec = Recorder()
    stack = TierStack(RamTier(10 * CHUNK_BYTES), make_ssd(tmp_path, rec), shared)
    hit = stack.get(KEYS[6], FP)
    assert hit is not None and hit.tier == "object"
    assert isinstance(hit.view.buffer, mmap.mmap)
    assert stack.residency(KEYS[6]) == ("ssd", "object")
    assert rec.by_reason("stored") == [KEYS[6]]
    again = stack.get(KEYS[6], FP)
    assert again is not None and again.tier == "ssd"
    assert torch.equal(again.view.tensor(), torch.arange(6, 262, dtype=torch.float32).view(SHAPE))


def test_stack_without_ssd_localizes_into_ram(tmp_path: Path) -> None:
    shared = make_shared(tmp_path, Recorder())
    shared.put(chunk(7))
    stack = TierStack(RamTier(10 * CHUNK_BYTES), None, None)
    hit = stack.fetch(KEYS[7], FP, remotes=[shared])
    assert hit is not None and hit.tier == "object"
    assert stack.residency(KEYS[7]) == ("ram",)
    assert stack.fetch(KEYS[0], FP, remotes=[shared]) is None


@pytest.mark.parametrize("kind", ["ram", "ssd"])
def test_concurrent_puts_and_gets_keep_the_bound_and_return_only_verified_chunks(tmp_path: Path, kind: str) -> None:
    rec = Recorder()
    tier = FACTORIES[kind](tmp_path, rec, chunks=3)
    blobs = [chunk(i) for i in range(8)]
    failures: list[str] = []
    start = threading.Barrier(4)

    def worker(offset: int) -> None:
        start.wait(timeout=10)
        for round_ in range(20):
            i = (offset + round_) % 8
            tier.put(blobs[i])
            view = tier.get(KEYS[i], FP)
            if view is not None and not torch.equal(
                view.tensor(), torch.arange(i, i + 256, dtype=torch.float32).view(SHAPE)
            ):
                failures.append(f"chunk {i} read back wrong")

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert failures == []
    assert tier.used_bytes <= 3 * CHUNK_BYTES  # type: ignore[attr-defined]
    held: set[bytes] = set()
    for event in rec.events:
        held |= set(event.stored)
        held -= set(event.removed)
    assert held == set(tier.keys())
    assert tier.counters().corrupt == 0


def test_ram_checking_headers_only_verifies_the_payload_once_at_admission(tmp_path: Path) -> None:
    rec = Recorder()
    tier = RamTier(10 * CHUNK_BYTES, rec.residency, rec.corruption, verify_payload=False)
    bad = chunk(0)
    bad[decode_header(bad).header_len + 3] ^= 0x01
    assert tier.put(bad) is False
    assert tier.keys() == [] and rec.events == []
    assert tier.counters().corrupt == 1 and [c.key for c in rec.corrupt] == [KEYS[0]]
    assert tier.put(chunk(1)) is True
    assert tier.get(KEYS[1], FP) is not None


def test_put_refuses_a_malformed_or_truncated_blob(tmp_path: Path, tier_kind: str) -> None:
    tier = FACTORIES[tier_kind](tmp_path, Recorder())
    with pytest.raises(ChunkCorrupt, match="magic"):
        tier.put(bytearray(b"not a chunk" * 20))
    with pytest.raises(ChunkCorrupt, match="declares"):
        tier.put(chunk(0)[:-1])
    assert tier.keys() == []


FULL_DISK_CHILD = """
import json, resource, signal, sys
from pathlib import Path
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (512, 512))  # the kernel refuses every file write past 512 bytes
from tests.unit.test_tiers import FP, KEYS, Recorder, chunk, make_ssd
from kvrelay.store.files import SharedDirTier
from kvrelay.store.ram import RamTier
from kvrelay.store.tier_stack import TierStack
tmp = Path(sys.argv[1])
ssd = make_ssd(tmp, Recorder())
stack = TierStack(RamTier(1 << 20), ssd, None)
hit = stack.fetch(KEYS[6], FP, remotes=[SharedDirTier(tmp / "shared")])
print(json.dumps({
    "put": stack.put(chunk(0)),
    "localized": hit is not None and hit.tier,
    "residency": stack.residency(KEYS[6]),
    "errors": ssd.counters().errors,
    "files": sorted(p.name for p in (tmp / "ssd").iterdir()),
}))
"""


def test_a_disk_that_refuses_writes_costs_the_ssd_copy_only(tmp_path: Path) -> None:
    """Written through the ssd tier of a full disk (the kernel refusing every write past 512 bytes), a chunk stays
    in ram and the write goes on; a chunk localized from elsewhere is kept in ram; nothing raises, no file stays."""
    import json
    import subprocess
    import sys

    make_shared(tmp_path, Recorder()).put(chunk(6))
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", FULL_DISK_CHILD, str(tmp_path)], capture_output=True, text=True, cwd=root, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out == {"put": ["ram"], "localized": "object", "residency": ["ram"], "errors": 2, "files": []}
    assert "cannot write chunk" in done.stderr
