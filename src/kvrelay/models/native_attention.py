"""A CPU fast path for batched decode attention: a C kernel (AVX-512 BF16), compiled on first use.

``decode_attention`` in PyTorch reads a decode step's keys and values through two
batched matmuls plus a softmax and the copies between them; on the 2-core CPU
this project is measured on, that streams the 15 sliding-window rings of Gemma 3
270M (252 MB per 32-lane step) at 8 to 12 GB/s. ``native/decode_attention.c``
reads each key and value row once, with software prefetch, and keeps scores in
the core's cache: 15 rings of 32 lanes x 512 keys took 14 to 17 ms against 23 to
29 ms for the PyTorch path in the same run (``bench/ring_attention.py``).

Numerics are the PyTorch path's in bfloat16 (scores rounded to bfloat16 before
scaling, softmax in float32, probabilities rounded to bfloat16, float32
accumulation); only the summation order differs, so an output can differ in its
last bit (``tests/unit/test_native_attention.py``).

The kernel is built with the C compiler (``$CC``, else ``cc``) into
``cache_dir()/native``, keyed by the digest of its source and flags, and loaded
with ``ctypes``. It runs its lanes on the calling thread's OpenMP team: torch's
own libgomp, which the dynamic loader reuses because torch loaded it first. It is
used only where it applies (CPU, bfloat16, query heads per KV head a multiple of
4, head dim a multiple of 128, AVX-512 BF16 present, a compiler present);
``KVRELAY_NATIVE_KERNELS=0`` turns it off. Anything else, including a failed
build (logged once), takes the PyTorch path: it stays the reference, and the one
for CUDA.
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

import torch

from kvrelay.paths import cache_dir

log = logging.getLogger(__name__)

DISABLE_ENV = "KVRELAY_NATIVE_KERNELS"
SOURCE = Path(__file__).with_name("native") / "decode_attention.c"
FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512bf16", "-fopenmp", "-shared", "-fPIC")
MAX_KEYS = 4095
"""The most keys one query may see (the C kernel's ``MAX_KEYS - 1``)."""
_CPU_FLAGS = ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16")


def decode_attention_native(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float
) -> torch.Tensor | None:
    """``decode_attention`` where sequence ``b`` sees its first ``visible[b]`` keys; ``None`` if the kernel
    does not apply here (then nothing was computed).

    ``q`` is ``[B, kv_heads, group, D]``; ``k`` and ``v`` are ``[B, kv_heads, S, D]``, strided alike with
    unit stride in the last dim (views of rings or gathered pages do); ``visible`` is ``[B]``, on the
    CPU, each in ``1 .. S``. Returns ``[B, kv_heads, group, D]``.
    """
    if not _applies(q, k, v, visible):
        return None
    lib = _library()
    if lib is None:
        return None
    batch, kv_heads, group, dim = q.shape
    q = q.contiguous()
    counts = visible.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    batch_stride, head_stride, row_stride, _ = k.stride()
    status = lib.kvrelay_decode_attention(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        counts.data_ptr(),
        out.data_ptr(),
        batch,
        kv_heads,
        group,
        dim,
        k.shape[2],
        batch_stride,
        head_stride,
        row_stride,
        scale,
    )
    if status != 0:
        raise ValueError(
            f"native decode attention rejected q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"visible {visible.tolist()}: each visible count must be in 1..{k.shape[2]}"
        )
    return out


def _applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> bool:
    if any(t.device.type != "cpu" or t.dtype != torch.bfloat16 or t.dim() != 4 for t in (q, k, v)):
        return False
    batch, kv_heads, group, dim = q.shape
    shapes_fit = k.shape == v.shape and k.shape[:2] == (batch, kv_heads) and k.shape[3] == dim
    strides_fit = k.stride() == v.stride() and k.stride(3) == 1
    kernel_fits = group % 4 == 0 and group <= 16 and dim % 128 == 0 and 0 < k.shape[2] <= MAX_KEYS
    return shapes_fit and strides_fit and kernel_fits and batch > 0 and visible.shape == (batch,)


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The built kernel, or ``None`` when it is turned off, unsupported here, or fails to build."""
    if os.environ.get(DISABLE_ENV) == "0":
        return None
    if not _cpu_supports():
        log.info("native decode attention is off: this CPU lacks AVX-512 BF16")
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.warning("native decode attention is off: no C compiler ($CC or cc) on PATH")
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except subprocess.CalledProcessError as exc:
        log.warning("native decode attention is off: %s failed on %s:\n%s", compiler, SOURCE, exc.stderr)
        return None
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("native decode attention is off: building or loading %s failed: %s", SOURCE, exc)
        return None
    fn = lib.kvrelay_decode_attention
    fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    fn.argtypes += [ctypes.c_int64] * 4 + [ctypes.c_float]
    fn.restype = ctypes.c_int
    return lib


def _build(compiler: str) -> Path:
    """The shared library for ``SOURCE``, compiled into the cache unless an identical build is there."""
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join((compiler, *FLAGS)).encode()).hexdigest()[:16]
    target = cache_dir() / "native" / f"decode_attention-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", str(built)], check=True, capture_output=True, text=True, timeout=120
        )
        os.replace(built, target)
    return target


def _cpu_supports() -> bool:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    return all(flag in flags for flag in _CPU_FLAGS)
