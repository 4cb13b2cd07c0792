"""A small, really full filesystem for tests: a tmpfs of a given size, mounted for the test and unmounted after.

``small_tmpfs(path, size)`` mounts a tmpfs of ``size`` (``mount -o size=``, e.g. ``"8m"``) on ``path`` and
skips the test, saying why, where this process may not mount (it needs root or CAP_SYS_ADMIN). ``fill(path)``
writes a filler file until the filesystem answers ENOSPC and returns it; deleting it frees the space again.
"""

from __future__ import annotations

import contextlib
import errno
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a {size} tmpfs on {path} (needs root or CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], check=True)


def fill(path: Path) -> Path:
    """Write ``path/filler`` until the filesystem is full (ENOSPC); the filler file."""
    filler = path / "filler"
    block = b"\0" * 65536
    with open(filler, "wb", buffering=0) as out:
        try:
            while True:
                out.write(block)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
        try:  # the last few bytes a block did not fit
            while True:
                out.write(b"\0" * 512)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
    return filler
