"""Build and load the C kernels of this package on first use.

``load(name, signatures, isa)`` compiles ``<name>.c`` (next to this file, with the
shared headers) for the instruction set ``isa`` (``"avx512"``: AVX-512 with BF16 and
VNNI, the default; ``"avx2"``: AVX2 with FMA) with the C compiler (``$CC``, else
``cc``) into ``cache_dir()/native``, keyed by the digest of the sources, compiler and
flags, loads it with ``ctypes`` and gives its functions their ``(argtypes, restype)``.
It returns ``None``, and the caller takes its PyTorch path, when the kernels are
turned off (``KVRELAY_NATIVE_KERNELS=0``), the CPU lacks ``isa``, no compiler is
found, or the build fails (logged once per kernel).

``best_isa()`` is the instruction set the kernels take here: ``"avx512"`` where the
CPU has it, else ``"avx2"``, else ``None``; ``KVRELAY_NATIVE_ISA=avx2`` makes an
AVX-512 CPU take the AVX2 kernels (to test or measure them there). The environment is
read on first use; ``clear_caches()`` makes the next call read it again. ``load_best(name,
signatures)`` loads ``<name>.c`` on ``"avx512"`` and its AVX2 port ``<name>_avx2.c``
on ``"avx2"`` (``None`` where there is none); ``load_amx(name, signatures)`` loads an AMX
kernel where the CPU has AMX (``KVRELAY_NATIVE_AMX=0`` turns those off). Kernels use OpenMP: the loader resolves
their ``libgomp.so.1`` to the copy torch loaded first, so they run on the calling
thread's torch team.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch  # noqa: F401  (loads torch's libgomp before any kernel, so kernels share it)

from kvrelay.paths import cache_dir

log = logging.getLogger(__name__)

DISABLE_ENV = "KVRELAY_NATIVE_KERNELS"
ISA_ENV = "KVRELAY_NATIVE_ISA"
COMMON_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")
ISA_FLAGS = {
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512bf16", "-mavx512vnni"),
    "avx2": ("-mavx2", "-mfma"),
}
"""The compiler flags of each instruction set the kernels are written for."""
AMX_FLAGS = (*ISA_FLAGS["avx512"], "-mamx-tile", "-mamx-int8", "-mamx-bf16")
"""The compiler flags of the AMX kernels (``load_amx``): AVX-512's and AMX's tiles with their int8 and bfloat16
products."""
AMX_ENV = "KVRELAY_NATIVE_AMX"
_AVX512_CPU_FLAGS = ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16", "avx512_vnni")
_CPU_FLAGS = {
    "avx512": _AVX512_CPU_FLAGS,
    "avx2": ("avx2", "fma"),
    "amx": (*_AVX512_CPU_FLAGS, "amx_tile", "amx_int8", "amx_bf16"),
}

Signature = tuple[tuple[Any, ...], Any]
"""A C function's ``ctypes`` argument types and result type."""


@functools.cache
def load(name: str, signatures: tuple[tuple[str, Signature], ...], isa: str = "avx512") -> ctypes.CDLL | None:
    """Kernel ``name`` built for ``isa`` and loaded, its functions typed by ``signatures``; ``None`` if it cannot
    run here."""
    if os.environ.get(DISABLE_ENV) == "0":
        return None
    if not cpu_supports(isa):
        log.info("native kernel %s is off: this CPU lacks %s", name, isa)
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.warning("native kernel %s is off: no C compiler ($CC or cc) on PATH", name)
        return None
    source = Path(__file__).with_name(f"{name}.c")
    try:
        flags = AMX_FLAGS if isa == "amx" else ISA_FLAGS[isa]
        lib = ctypes.CDLL(str(_build(source, compiler, (*COMMON_FLAGS, *flags))))
    except subprocess.CalledProcessError as exc:
        log.warning("native kernel %s is off: %s failed on %s:\n%s", name, compiler, source, exc.stderr)
        return None
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("native kernel %s is off: building or loading %s failed: %s", name, source, exc)
        return None
    for function, (argtypes, restype) in signatures:
        getattr(lib, function).argtypes = list(argtypes)
        getattr(lib, function).restype = restype
    return lib


@functools.cache
def load_best(name: str, signatures: tuple[tuple[str, Signature], ...]) -> ctypes.CDLL | None:
    """Kernel ``name`` for ``best_isa()``: ``<name>.c`` on AVX-512, ``<name>_avx2.c`` on AVX2; ``None`` where it
    cannot run or has no port to that instruction set."""
    isa = best_isa()
    if isa is None:
        return None
    source = name if isa == "avx512" else f"{name}_{isa}"
    if not Path(__file__).with_name(f"{source}.c").is_file():
        return None
    return load(source, signatures, isa)


_AMX_REQUEST: tuple[str, Signature] = ("kvrelay_amx_request", ((), ctypes.c_int))
"""What every AMX kernel exports (``amx_tiles.h``): the request for the process's tile state."""


@functools.cache
def load_amx(name: str, signatures: tuple[tuple[str, Signature], ...]) -> ctypes.CDLL | None:
    """Kernel ``name`` built with AMX (``<name>.c``), where the kernels take AVX-512, the CPU has AMX's int8 and
    bfloat16 tiles, ``KVRELAY_NATIVE_AMX`` is not ``0`` and Linux granted this process the tile state (asked
    here); else ``None``."""
    if best_isa() != "avx512" or os.environ.get(AMX_ENV) == "0":
        return None
    lib = load(name, (_AMX_REQUEST, *signatures), "amx")
    if lib is None or lib.kvrelay_amx_request() != 0:
        return None
    return lib


@functools.cache
def best_isa() -> str | None:
    """The instruction set the kernels take here (see the module docstring), decided on the first call."""
    if os.environ.get(ISA_ENV) != "avx2" and cpu_supports("avx512"):
        return "avx512"
    return "avx2" if cpu_supports("avx2") else None


def clear_caches() -> None:
    """Forget every loaded kernel and the instruction set picked, so the next call reads the environment again
    (for tests that change ``KVRELAY_NATIVE_KERNELS``, ``KVRELAY_NATIVE_ISA`` or ``CC``)."""
    load.cache_clear()
    load_best.cache_clear()
    load_amx.cache_clear()
    best_isa.cache_clear()


def _build(source: Path, compiler: str, flags: tuple[str, ...]) -> Path:
    """The shared library of ``source``, compiled into the cache unless an identical build is there.

    The key covers the source, the headers beside it (which the kernels include), the compiler and the flags.
    """
    headers = sorted(source.parent.glob("*.h"))
    text = b"".join(path.read_bytes() for path in (source, *headers))
    key = hashlib.sha256(text + " ".join((compiler, *flags)).encode()).hexdigest()[:16]
    target = cache_dir() / "native" / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run(
            [compiler, *flags, str(source), "-o", str(built)], check=True, capture_output=True, text=True, timeout=120
        )
        os.replace(built, target)
    return target


def cpu_supports(isa: str = "avx512") -> bool:
    """Whether this CPU has the extensions of ``isa`` (``"avx512"``, ``"avx2"`` or ``"amx"``)."""
    return all(flag in _cpu_flags() for flag in _CPU_FLAGS[isa])


@functools.cache
def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags, read once from ``/proc/cpuinfo`` (empty where it cannot be read)."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return frozenset(
        next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    )
