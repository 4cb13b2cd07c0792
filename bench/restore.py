"""Restore throughput of the chunk tiers into pages, next to a plain memory copy of the same bytes.

A chunk stands in for Gemma 3 270M KV of 64 tokens: [18 layers, 2 (k, v), 64
tokens, 1 kv head, 256 head_dim] in ``--dtype`` (bf16: 1.18 MB of KV). ``--chunks``
distinct chunks are restored per pass into a preallocated tensor standing in for
the device pages (``pages[i].copy_(chunk)``); a figure is payload bytes over the
fastest pass time, in GB/s. Each restore is the real read path: look up, map or
download, verify (header digest and, for "verified" figures, the XXH3-128 payload
digest), view in place, copy.

Every figure carries its own baseline ``memcpy``: the same bytes copied from one
host tensor into the same pages, timed in passes alternating with the figure's
passes (so both see the same load on a shared machine). Figures:

- ``blake2b``: blake2b-16 over the stored chunks alone, the payload digest of chunk format 1
  (format 2's XXH3 replaced it: docs/performance.md, "Chunk payload digest"), kept to compare;
- ``ram_verified`` / ``ram_header_only``: ``RamTier`` verifying every read / checking the
  header on reads (its payload digest was checked once, when the chunk was admitted);
- ``ssd_cached_*``: ``SsdTier`` files in the page cache, read through mmap;
- ``ssd_dropped_*``: the same after ``posix_fadvise(POSIX_FADV_DONTNEED)``
  of every file before each pass (the files are fsynced, so the pages can go);
- ``s3_verified``: ``S3Tier`` against a moto_server on loopback (``--s3-chunks``);
  ``s3_localized_verified``: S3 to the local ssd tier, read back mapped;
- ``peer_verified``: ``PeerTier`` from a ``PeerServer`` on loopback serving a ram tier (as a
  worker's); ``peer_localized_verified``: the same through a worker's stack (ram and ssd tiers),
  which keeps a peer's chunk in ram.

Copies run with ``--torch-threads`` (1) intra-op threads, as on one restore
thread. With ``--threads N`` (N > 1) the chunks of a pass restore on N threads (hashlib's blake2b
and the copies release the GIL) and the ``*_verified`` figures get a ``_tN`` twin.
Goal: ram and page-cached ssd at least 50% of memcpy.

Run: ``.venv/bin/python bench/restore.py --json bench-restore.json``
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kvrelay.bench.report import Figure, report  # noqa: E402
from kvrelay.protocol.chunk_keys import chunk_chain  # noqa: E402
from kvrelay.store.chunk_format import digest, encode_chunk  # noqa: E402
from kvrelay.store.files import SsdTier  # noqa: E402
from kvrelay.store.peer import PeerServer, PeerTier  # noqa: E402
from kvrelay.store.ram import RamTier  # noqa: E402
from kvrelay.store.tier import ChunkSource, ChunkTier  # noqa: E402
from kvrelay.store.tier_stack import TierStack  # noqa: E402

GEMMA3_270M_CHUNK_SHAPE = (18, 2, 64, 1, 256)
FINGERPRINT = b"bench-restore|gemma3-270m|64"


def make_chunks(count: int, dtype: torch.dtype, seed: int = 0) -> tuple[list[bytes], list[bytearray]]:
    """``count`` distinct random chunks: their keys and stored forms."""
    keys = list(chunk_chain(FINGERPRINT, list(range(64 * count)), 64))
    gen = torch.Generator().manual_seed(seed)
    blobs = [encode_chunk(k, FINGERPRINT, torch.randn(GEMMA3_270M_CHUNK_SHAPE, generator=gen).to(dtype)) for k in keys]
    return keys, blobs


def paired_seconds(
    subject: Callable[[], None],
    baseline: Callable[[], None],
    repeats: int,
    before_subject: Callable[[], None] | None = None,
) -> tuple[float, float]:
    """Fastest-pass seconds of ``subject`` and of ``baseline``, passes alternated so both see the same load.

    The fastest pass is the one least disturbed by other processes (the timeit
    convention). One warm-up pass of each comes first; ``before_subject`` runs
    untimed before every subject pass.
    """
    subject_times, baseline_times = [], []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        baseline()
        baseline_times.append(time.perf_counter() - start)
        if before_subject is not None:
            before_subject()
        start = time.perf_counter()
        subject()
        subject_times.append(time.perf_counter() - start)
    return min(subject_times[1:]), min(baseline_times[1:])


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def memcpy_pass(pages: torch.Tensor) -> Callable[[], None]:
    """A pass copying host memory of the pages' size into the pages, chunk by chunk (the baseline)."""
    source = torch.randn(pages.shape).to(pages.dtype)

    def one_pass() -> None:
        for i in range(pages.shape[0]):
            pages[i].copy_(source[i])

    return one_pass


def measure_digest(blobs: Sequence[bytearray], pages: torch.Tensor, repeats: int) -> tuple[float, float]:
    """GB/s of blake2b-16 over the stored chunks (format 1's payload verification), and of memcpy."""

    def one_pass() -> None:
        for blob in blobs:
            digest(blob)

    subject, baseline = paired_seconds(one_pass, memcpy_pass(pages), repeats)
    return gbps(sum(len(b) for b in blobs), subject), gbps(pages.numel() * pages.element_size(), baseline)


def measure_restore(
    source: ChunkSource | Callable[[bytes], object],
    keys: Sequence[bytes],
    pages: torch.Tensor,
    repeats: int,
    threads: int = 1,
    before_pass: Callable[[], None] | None = None,
) -> tuple[float, float]:
    """GB/s of restoring ``keys`` from ``source`` into ``pages`` (a miss raises), and of memcpy of the same bytes."""
    lookup = source.get if isinstance(source, ChunkSource) else source
    pages = pages[: len(keys)]

    def restore(i: int) -> None:
        found = lookup(keys[i])
        if found is None:
            raise RuntimeError(f"chunk {keys[i].hex()} missed in the restore benchmark")
        getattr(found, "view", found).copy_into(pages[i])

    indices = range(len(keys))
    nbytes = pages.numel() * pages.element_size()
    with ThreadPoolExecutor(max(threads, 1)) as pool:
        one_pass = (
            (lambda: list(pool.map(restore, indices))) if threads > 1 else (lambda: [restore(i) for i in indices])
        )
        subject, baseline = paired_seconds(one_pass, memcpy_pass(pages), repeats, before_pass)
    return gbps(nbytes, subject), gbps(nbytes, baseline)


def fill(tier: ChunkTier, blobs: Sequence[bytearray]) -> ChunkTier:
    for blob in blobs:
        tier.put(blob)
    return tier


def measure_ram(
    keys: Sequence[bytes], blobs: Sequence[bytearray], pages: torch.Tensor, repeats: int, verify: bool, threads: int = 1
) -> tuple[float, float]:
    tier = fill(RamTier(sum(len(b) for b in blobs), verify_payload=verify), blobs)
    return measure_restore(tier, keys, pages, repeats, threads)


def measure_ssd_cached(
    tier: SsdTier, keys: Sequence[bytes], pages: torch.Tensor, repeats: int, threads: int = 1
) -> tuple[float, float]:
    return measure_restore(tier, keys, pages, repeats, threads)


def drop_from_page_cache(paths: Sequence[Path]) -> None:
    """Ask the kernel to drop the (clean, fsynced) pages of ``paths`` from the page cache."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measure_ssd_dropped(
    tier: SsdTier, keys: Sequence[bytes], pages: torch.Tensor, repeats: int, threads: int = 1
) -> tuple[float, float]:
    paths = [tier.path_for(k) for k in keys]
    return measure_restore(tier, keys, pages, repeats, threads, before_pass=lambda: drop_from_page_cache(paths))


def direct_and_localized(
    remote: ChunkSource,
    localize: Callable[[bytes], object],
    local: Sequence[ChunkTier],
    keys: Sequence[bytes],
    pages: torch.Tensor,
    repeats: int,
) -> tuple[tuple[float, float], tuple[float, float]]:
    """(GB/s, memcpy GB/s) of restoring ``keys`` from ``remote`` straight into pages, then through ``localize``
    (a worker's stack keeping a local copy in ``local``), each localized pass starting without those copies."""
    direct = measure_restore(remote, keys, pages, repeats)

    def forget_localized() -> None:
        for key in keys:
            for tier in local:
                tier.remove(key)

    return direct, measure_restore(localize, keys, pages, repeats, before_pass=forget_localized)


def measure_s3(
    keys: Sequence[bytes], blobs: Sequence[bytearray], pages: torch.Tensor, repeats: int, workdir: Path
) -> tuple[tuple[float, float], tuple[float, float]]:
    """(GB/s, memcpy GB/s) from S3 on a loopback moto_server: direct into pages, and localized through ssd."""
    from kvrelay.store.s3 import S3Tier
    from kvrelay.testing.moto import running_moto_server

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    with running_moto_server() as endpoint:
        s3 = S3Tier(S3Tier.make_client(endpoint), "kvrelay-bench", "restore/")
        s3.create_bucket()
        fill(s3, blobs)
        local_ssd = SsdTier(workdir / "localized", 1 << 40)
        stack = TierStack(None, local_ssd, None)
        return direct_and_localized(s3, lambda k: stack.localize(k, FINGERPRINT, s3), [local_ssd], keys, pages, repeats)


def measure_peer(
    keys: Sequence[bytes], blobs: Sequence[bytearray], pages: torch.Tensor, repeats: int, workdir: Path
) -> tuple[tuple[float, float], tuple[float, float]]:
    """(GB/s, memcpy GB/s) from a peer server on loopback: direct into pages, and localized through a worker's
    stack (ram, then ssd), each pass starting without the local copies."""
    server = PeerServer([fill(RamTier(sum(len(b) for b in blobs), verify_payload=False), blobs)])
    try:
        peer = PeerTier(server.url)
        local_ram = RamTier(sum(len(b) for b in blobs), verify_payload=False)
        local_ssd = SsdTier(workdir / "peer-localized", 1 << 40)
        stack = TierStack(local_ram, local_ssd, None)
        return direct_and_localized(
            peer, lambda k: stack.fetch(k, FINGERPRINT, [peer]), [local_ram, local_ssd], keys, pages, repeats
        )
    finally:
        server.close()


def run_all(args: argparse.Namespace) -> list[Figure]:
    """Every figure, each next to the memcpy baseline measured alternately with it."""
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    keys, blobs = make_chunks(args.chunks, dtype)
    pages = torch.empty((args.chunks, *GEMMA3_270M_CHUNK_SHAPE), dtype=dtype)
    repeats = args.repeats
    figures: list[Figure] = []

    def add(name: str, measured: tuple[float, float]) -> None:
        figures.append(Figure(name, measured[0], "GB/s", "memcpy", measured[1]))

    add("blake2b", measure_digest(blobs, pages, repeats))
    add("ram_verified", measure_ram(keys, blobs, pages, repeats, verify=True))
    add("ram_header_only", measure_ram(keys, blobs, pages, repeats, verify=False))
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="kvrelay-bench-restore-") as tmp:
        workdir = Path(tmp)
        ssd = SsdTier(workdir / "ssd", 1 << 40)
        fill(ssd, blobs)
        unverified = SsdTier(workdir / "ssd", 1 << 40, verify_payload=False)
        # Mapped once and kept (the tier's default), and mapped afresh on every read: a dropped page cache
        # only shows with fresh mappings, since kept mappings pin their pages.
        fresh = SsdTier(workdir / "ssd", 1 << 40, open_maps=0)
        fresh_unverified = SsdTier(workdir / "ssd", 1 << 40, verify_payload=False, open_maps=0)
        add("ssd_cached_verified", measure_ssd_cached(ssd, keys, pages, repeats))
        add("ssd_cached_header_only", measure_ssd_cached(unverified, keys, pages, repeats))
        add("ssd_cached_verified_fresh_map", measure_ssd_cached(fresh, keys, pages, repeats))
        add("ssd_dropped_verified", measure_ssd_dropped(fresh, keys, pages, repeats))
        add("ssd_dropped_header_only", measure_ssd_dropped(fresh_unverified, keys, pages, repeats))
        if args.threads > 1:
            t = args.threads
            add(f"ram_verified_t{t}", measure_ram(keys, blobs, pages, repeats, verify=True, threads=t))
            add(f"ssd_cached_verified_t{t}", measure_ssd_cached(ssd, keys, pages, repeats, threads=t))
            add(f"ssd_dropped_verified_t{t}", measure_ssd_dropped(fresh, keys, pages, repeats, threads=t))
        direct, localized = measure_peer(keys, blobs, pages, repeats, workdir)
        add("peer_verified", direct)
        add("peer_localized_verified", localized)
        if args.s3_chunks > 0:
            n = min(args.s3_chunks, args.chunks)
            direct, localized = measure_s3(keys[:n], blobs[:n], pages[:n], repeats, workdir)
            add("s3_verified", direct)
            add("s3_localized_verified", localized)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument(
        "--chunks", type=int, default=64, help="distinct chunks restored per pass (default 64: 75 MB in bf16)"
    )
    parser.add_argument("--s3-chunks", type=int, default=16, help="chunks per S3 pass (0 skips S3)")
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed passes per figure (the fastest counts); one warm-up pass first"
    )
    parser.add_argument("--threads", type=int, default=1, help="also measure verified restores on this many threads")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads for the copies (default 1, as on one restore thread)",
    )
    parser.add_argument("--dir", default=None, help="directory for the ssd files (default: the system temp dir)")
    parser.add_argument("--json", default=None, help="write the figures as JSON to this path")
    args = parser.parse_args(argv)
    if args.chunks < 1 or args.repeats < 1:
        parser.error("--chunks and --repeats must be at least 1")
    torch.set_num_threads(args.torch_threads)
    figures = run_all(args)
    report(f"restore throughput, {args.chunks} chunks of {GEMMA3_270M_CHUNK_SHAPE} {args.dtype}", figures, args.json)
    for f in figures:
        print(f"  {f.name}: {100 * f.value / (f.baseline_value or 1.0):.0f}% of memcpy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
