"""A writer killed (SIGKILL) in the middle of a chunk write never leaves a readable partial chunk.

The writer is a real subprocess running the real tier code. Its write path is
slowed at one seam (the file tier's piece writer, or the S3 request body) so it
stops after half the bytes, tells the test through its stdout pipe, and blocks
on its stdin; the test then kills it. No sleeps: the handshake is the pipe.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvrelay.protocol.chunk_keys import chunk_chain
from kvrelay.store.files import SharedDirTier, SsdTier
from kvrelay.store.s3 import S3Tier
from tests.support.fixtures import use_test_credentials

FP = b"atomic-write-test"
KEY = chunk_chain(FP, list(range(64)), 64)[0]
HANDSHAKE_TIMEOUT_S = 60.0

MAKE_BLOB = f"""
import torch
from kvrelay.store.chunk_format import encode_chunk
values = torch.arange(18 * 2 * 64 * 64, dtype=torch.float32).view(18, 2, 64, 1, 64)
blob = encode_chunk(bytes.fromhex({KEY.hex()!r}), {FP!r}, values)
"""

FILE_WRITER = (
    MAKE_BLOB
    + """
import os, sys
from kvrelay.store import files

def half_then_block(fd, data):
    half = data.nbytes // 2
    written = 0
    while written < half:
        written += os.write(fd, data[written:half])
    sys.stdout.write("half\\n")
    sys.stdout.flush()
    sys.stdin.read()

files._write_all = half_then_block
tier_class = {"ssd": files.SsdTier, "shared": files.SharedDirTier}[sys.argv[1]]
tier = tier_class(sys.argv[2], 1 << 30) if sys.argv[1] == "ssd" else tier_class(sys.argv[2])
tier.put(blob)
"""
)

S3_WRITER = (
    MAKE_BLOB
    + """
import io, sys
from kvrelay.store import s3

class HalfThenBlockWhileSending(io.BytesIO):
    # SigV4 over http hashes the body first (botocore/auth.py); only the send pass blocks.
    def read(self, size=-1):
        half = len(self.getbuffer()) // 2
        sending = "botocore/auth.py" not in sys._getframe(1).f_code.co_filename
        if sending and self.tell() >= half:
            sys.stdout.write("half\\n")
            sys.stdout.flush()
            sys.stdin.read()
        if sending:
            size = min(half - self.tell(), 8192 if size is None or size < 0 else size)
        return super().read(size)

s3._request_body = lambda blob: HalfThenBlockWhileSending(bytes(blob))
tier = s3.S3Tier(s3.S3Tier.make_client(sys.argv[1]), sys.argv[2], "chunks/")
tier.create_bucket()
tier.put(blob)
"""
)


def _start_writer(script: str, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
    )


def _kill_at_half(proc: subprocess.Popen[bytes]) -> None:
    """Wait for the writer's 'half' line (bounded), then SIGKILL it."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], HANDSHAKE_TIMEOUT_S)
    line = proc.stdout.readline() if ready else b""
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert line == b"half\n", f"writer never reached the middle of its write (exit {proc.returncode})"
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.parametrize("kind", ["ssd", "shared"])
def test_killed_file_writer_leaves_no_readable_chunk(tmp_path: Path, kind: str) -> None:
    directory = tmp_path / kind
    proc = _start_writer(FILE_WRITER, kind, str(directory))
    _kill_at_half(proc)
    leftovers = [p for p in directory.iterdir()]
    assert [p.name.endswith(".tmp") and p.name.startswith(".") for p in leftovers] == [True]
    assert 0 < leftovers[0].stat().st_size < 18 * 2 * 64 * 64 * 4
    assert not (directory / f"{KEY.hex()}.kvc").exists()
    shared = SharedDirTier(directory)
    assert shared.get(KEY, FP) is None and not shared.contains(KEY) and shared.keys() == []
    assert shared.counters().corrupt == 0
    ssd = SsdTier(directory, 1 << 30)
    assert ssd.get(KEY, FP) is None and ssd.keys() == []
    assert list(directory.iterdir()) == []


def test_killed_s3_writer_leaves_no_readable_object(
    moto_endpoint: str,
    monkeypatch: pytest.MonkeyPatch,  # noqa: F811
) -> None:
    use_test_credentials(monkeypatch)
    proc = _start_writer(S3_WRITER, moto_endpoint, "kvrelay-atomic")
    _kill_at_half(proc)
    tier = S3Tier(S3Tier.make_client(moto_endpoint), "kvrelay-atomic", "chunks/")
    assert tier.get(KEY, FP) is None
    assert tier.keys() == [] and not tier.contains(KEY)
    assert tier.counters().corrupt == 0
