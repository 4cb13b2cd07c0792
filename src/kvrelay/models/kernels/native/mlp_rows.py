"""The gated MLP of a decode step's few bfloat16 rows in one parallel region, and on AMX a decoder layer's
whole work after its attention: C kernels.

``DecodeMLP.build(gate, up, down, activation)`` holds what the kernel reads; ``mlp(x)`` is
``down(act(gate x) * up x)`` for ``x`` of 1 to ``mlp.max_rows`` rows, with ``mlp.GatedMLP``'s post-op
numerics up to summation order (``mlp_rows.c`` states them; ``tests/unit/test_native_mlp_rows.py``).
Through oneDNN the same MLP is three parallel regions, each a wake-up of a passive OpenMP partner;
here it is one, with a spin barrier between the intermediate and the output (why and how fast:
docs/performance.md, "Decode MLP in one region"). Where the CPU has AMX the dot products run in
bfloat16 tiles (``mlp_rows_amx.c``) over a copy of the weights laid out once in tile order, for up to
``AMX_ROWS`` rows; elsewhere on AVX-512 BF16 as ``vdpbf16ps`` chains over the weights as they are
(``mlp_rows.c``), for up to ``AVX512_ROWS`` rows.

``LayerTail`` adds the output projection and the norms with their residual adds to that region (on AMX
tiles, or with ``vdpbf16ps`` chains for up to ``AVX512_ROWS`` rows; ``layer_tail.h``), and where linked
(``LayerTail.with_next``) the next layer's input norm, q/k/v projection and q/k norms with rope
(``NextHead``). Everything applies to bfloat16 rows and contiguous bfloat16
weights without bias on the CPU, widths multiples of 32, the activations of ``ACTIVATION_CODES``,
where the kernel is built (``build``); else ``None`` (or False) and nothing is computed.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kvrelay.models.kernels.huge_pages import huge_page_empty
from kvrelay.models.kernels.native.build import load, load_amx

AVX512_ROWS = 32
"""The most rows ``mlp_rows.c`` takes: a decode step of 32 lanes through its tail ran at least as fast as through
oneDNN and the separate calls on the 2-core EPYC (docs/performance.md, "Decode MLP in one region")."""
AMX_ROWS = 32
"""The most rows ``mlp_rows_amx.c`` takes (two A tiles of 16 rows)."""

ACTIVATION_CODES = {"silu": 0, "gelu_tanh": 1, "gelu": 2}
"""The activations the kernels compute, by the name they are given, and their code in C."""

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_ARGS = (_P, _I64, _I64, _P, _P, _I64, _P, _INT, _P, _P)
"""x, M, H, gate, up, I, down, act, mid, y (``mlp_rows.c``, ``mlp_rows_amx.c``)."""
_TAIL_ARGS = (_P, _I64, _P, _P, _I64, _I64, _P, _P, _P, ctypes.c_float, _INT, _P, _P, _I64, _P, _INT, _P, _P)
"""attn, A, o (tiles on AMX), h, M, H, the three norms, eps, unit_offset, gate, up, I, down, act, scratch, next."""
_SIGNATURES = (("kvrelay_mlp_rows", (_ARGS, _INT)), ("kvrelay_layer_tail", (_TAIL_ARGS, _INT)))
_AMX_SIGNATURES = (
    ("kvrelay_bf16_pack_tiles", ((_P, _I64, _I64, _P), _INT)),
    ("kvrelay_mlp_rows_amx", (_ARGS, _INT)),
    ("kvrelay_layer_tail_amx", (_TAIL_ARGS, _INT)),
)


class _NextHead(ctypes.Structure):
    """``layer_tail.h``'s ``NextHead``."""

    _fields_ = (
        ("in_norm_w", ctypes.c_void_p),
        ("qkv_w", ctypes.c_void_p),
        ("N", ctypes.c_int64),
        ("qk_heads", ctypes.c_int64),
        ("D", ctypes.c_int64),
        ("qk_norm_w", ctypes.c_void_p),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
        ("qkv", ctypes.c_void_p),
    )


@dataclass(frozen=True, slots=True)
class NextHead:
    """The start of the next layer that a ``LayerTail`` may compute in its region: its input norm's weight
    (float32 ``[H]``), its fused q, k, v projection (``[N, H]``, as the tail's kernel reads weights: tiles on AMX),
    and its q and k heads' norm weights (float32 ``[qk_heads, D]``); the rope tables come with each call."""

    in_norm_w: torch.Tensor
    qkv_w: torch.Tensor
    qk_heads: int
    head_dim: int
    qk_norm_w: torch.Tensor


def library() -> ctypes.CDLL | None:
    """The AVX-512 kernel, built and loaded (``None`` where it cannot run)."""
    return load("mlp_rows", _SIGNATURES)


def amx_library() -> ctypes.CDLL | None:
    """The AMX kernel, where it is built and this process may use the tiles; else ``None``."""
    return load_amx("mlp_rows_amx", _AMX_SIGNATURES)


class DecodeMLP:
    """One MLP's weights as a decode kernel reads them (see the module docstring); ``max_rows`` per call."""

    def __init__(
        self,
        lib: ctypes.CDLL,
        entry: str,
        weights: tuple[torch.Tensor, ...],
        shape: tuple[int, int],
        code: int,
        rows: int,
    ) -> None:
        """``weights``: gate, up and down as ``entry`` reads them; ``shape``: ``(hidden, inner)``."""
        self.lib = lib
        self.tiled = entry == "kvrelay_mlp_rows_amx"
        """Whether ``weights`` are AMX tiles (so ``LayerTail`` lays its weights out as tiles too)."""
        self._call = getattr(lib, entry)
        self.weights = weights
        self.hidden, self.inner = shape
        self.code = code
        self.max_rows = rows

    @classmethod
    def build(
        cls, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, activation: str, amx: bool = True
    ) -> DecodeMLP | None:
        """The kernel's view of ``gate``, ``up`` (``[I, H]``) and ``down`` (``[H, I]``): with AMX tiles where they
        run (a tile-order copy of each weight) unless ``amx`` is False, else the AVX-512 kernel over the weights
        as they are; ``None`` where neither takes them."""
        code = ACTIVATION_CODES.get(activation)
        if code is None or not _weights_fit(gate, up, down):
            return None
        shape = (gate.shape[1], gate.shape[0])
        lib = amx_library() if amx else None
        if lib is not None:
            tiles = tuple(_tiles(lib, w) for w in (gate, up, down))
            return cls(lib, "kvrelay_mlp_rows_amx", tiles, shape, code, AMX_ROWS)
        lib = library()
        return None if lib is None else cls(lib, "kvrelay_mlp_rows", (gate, up, down), shape, code, AVX512_ROWS)

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """The MLP of ``x`` (``[M, H]`` bfloat16, ``1 <= M <= max_rows``) as ``[M, H]``; ``None`` where ``x`` does
        not fit (nothing computed)."""
        fits = x.dim() == 2 and x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.shape[1] == self.hidden
        if not fits or not 1 <= x.shape[0] <= self.max_rows:
            return None
        x = x.contiguous()
        rows = x.shape[0]
        mid = torch.empty(rows, self.inner, dtype=torch.bfloat16)
        out = torch.empty(rows, self.hidden, dtype=torch.bfloat16)
        gate, up, down = (w.data_ptr() for w in self.weights)
        status = self._call(
            x.data_ptr(), rows, self.hidden, gate, up, self.inner, down, self.code, mid.data_ptr(), out.data_ptr()
        )
        return None if status else out


def _weights_fit(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> bool:
    tensors = (gate, up, down)
    if not all(t.device.type == "cpu" and t.dtype == torch.bfloat16 and t.dim() == 2 for t in tensors):
        return False
    inner, hidden = gate.shape
    shapes = up.shape == (inner, hidden) and down.shape == (hidden, inner)
    return shapes and hidden % 32 == 0 and inner % 32 == 0 and all(t.is_contiguous() for t in tensors)


def _tiles(lib: ctypes.CDLL, weight: torch.Tensor) -> torch.Tensor:
    """``weight`` in the tile order ``mlp_rows_amx.c`` reads (as many values, laid out once)."""
    tiles = huge_page_empty(tuple(weight.shape), torch.bfloat16)
    if lib.kvrelay_bf16_pack_tiles(weight.data_ptr(), weight.shape[0], weight.shape[1], tiles.data_ptr()):
        raise ValueError(f"a weight of shape {tuple(weight.shape)} does not pack into 16 x 32 tiles")
    return tiles


class LayerTail:
    """A decoder layer after its attention, for a decode step's rows, in one parallel region:
    ``h += N_post_attn(o(attn))``, ``x = N_pre_ff(h)``, ``h += N_post_ff(mlp(x))``, each step rounded as the
    separate kernels round it (``layer_tail.h``, run by the kernel of ``mlp``: ``kvrelay_layer_tail_amx`` over
    tiles, ``kvrelay_layer_tail`` over the weights as they are). A norm given as ``None`` is the
    identity (Llama has no post-attention or post-feedforward norm); norms are ``RMSNorm.kernel_weight``s.
    Through separate calls the same work is four parallel regions (the output projection and the MLP's three)
    or two with ``DecodeMLP``, plus three norm calls (why and how fast: docs/performance.md, "Decode MLP in one
    region")."""

    def __init__(
        self,
        o_w: torch.Tensor,
        mlp: DecodeMLP,
        norms: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None],
        eps: float,
        unit_offset: bool,
    ) -> None:
        self.o_w = o_w
        """The output projection as the kernel reads it (tiles on AMX, else the weight itself)."""
        self.mlp = mlp
        self.norms = norms
        self.eps = eps
        self.unit_offset = unit_offset
        self.width = o_w.shape[1]
        self.max_rows = mlp.max_rows
        self.next: NextHead | None = None
        """The next layer's start, computed in the same region where set (``with_next``)."""

    def with_next(
        self, in_norm_w: torch.Tensor, qkv_weight: torch.Tensor, qk_heads: int, head_dim: int, qk_norm_w: torch.Tensor
    ) -> bool:
        """Also compute the next layer's normed input, its q, k, v projection (``qkv_weight`` ``[N, H]``) and its q
        and k heads' norm and rope (see ``NextHead``); False where they do not fit (nothing changes)."""
        hidden = self.mlp.hidden
        fits = (
            qkv_weight.dtype == torch.bfloat16
            and qkv_weight.is_contiguous()
            and qkv_weight.dim() == 2
            and qkv_weight.shape[1] == hidden
            and qkv_weight.shape[0] % 32 == 0
            and head_dim % 32 == 0
            and head_dim <= 1024
            and qk_heads * head_dim <= qkv_weight.shape[0]
            and in_norm_w.shape == (hidden,)
            and qk_norm_w.shape == (qk_heads, head_dim)
            and all(w.dtype == torch.float32 and w.is_contiguous() for w in (in_norm_w, qk_norm_w))
        )
        if fits:
            self.next = NextHead(in_norm_w, self._as_read(qkv_weight), qk_heads, head_dim, qk_norm_w)
        return fits

    @classmethod
    def build(
        cls,
        o_weight: torch.Tensor,
        mlp: DecodeMLP | None,
        norms: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None],
        eps: float,
        unit_offset: bool,
    ) -> LayerTail | None:
        """The tail of ``o_weight`` (``[H, A]`` bfloat16, contiguous, no bias) and ``mlp`` with the three norms'
        float32 weights (``[H]``, contiguous); ``None`` where it does not apply."""
        if mlp is None or o_weight.dtype != torch.bfloat16 or not o_weight.is_contiguous():
            return None
        hidden, width = o_weight.shape
        given = [n for n in norms if n is not None]
        norms_fit = all(n.dtype == torch.float32 and n.shape == (hidden,) and n.is_contiguous() for n in given)
        if hidden != mlp.hidden or width % 32 or not norms_fit:
            return None
        return cls(_tiles(mlp.lib, o_weight) if mlp.tiled else o_weight, mlp, norms, eps, unit_offset)

    def _as_read(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` as the tail's kernel reads it."""
        return _tiles(self.mlp.lib, weight) if self.mlp.tiled else weight

    def __call__(self, attn: torch.Tensor, h: torch.Tensor) -> bool:
        """Apply the tail to ``h`` (``[M, H]`` bfloat16, contiguous) in place from ``attn`` (``[M, A]``); False
        where they do not fit (nothing computed)."""
        return self._run(attn, h, None) is not None

    def through_next(
        self, attn: torch.Tensor, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor | None:
        """``self(attn, h)``, then the next layer's ``[M, N]`` q, k, v rows (q and k heads normed and rotated by
        ``cos`` and signed ``sin``, ``[M, 1, D]``), as its attention would compute them from ``h``; ``None``
        where they do not fit or no next layer is set (nothing computed)."""
        nxt = self.next
        rows = h.shape[0]
        if nxt is None or cos.shape != (rows, 1, nxt.head_dim) or sin.shape != cos.shape:
            return None
        if cos.dtype != torch.bfloat16 or sin.dtype != torch.bfloat16:
            return None
        qkv = torch.empty(rows, nxt.qkv_w.shape[0], dtype=torch.bfloat16)
        cos, sin = cos.contiguous(), sin.contiguous()
        head = _NextHead(
            nxt.in_norm_w.data_ptr(),
            nxt.qkv_w.data_ptr(),
            nxt.qkv_w.shape[0],
            nxt.qk_heads,
            nxt.head_dim,
            nxt.qk_norm_w.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            qkv.data_ptr(),
        )
        return qkv if self._run(attn, h, head) is not None else None

    def _run(self, attn: torch.Tensor, h: torch.Tensor, head: _NextHead | None) -> torch.Tensor | None:
        """The kernel call; ``h`` when it ran, else ``None``."""
        rows = h.shape[0]
        fits = attn.dim() == 2 and attn.shape == (rows, self.width) and attn.dtype == h.dtype == torch.bfloat16
        if not fits or not 1 <= rows <= self.max_rows or not h.is_contiguous() or h.shape[1] != self.mlp.hidden:
            return None
        attn = attn.contiguous()
        hidden, inner = self.mlp.hidden, self.mlp.inner
        scratch = torch.empty(rows * (3 * hidden + inner), dtype=torch.bfloat16)
        post_attn, pre_ff, post_ff = (0 if n is None else n.data_ptr() for n in self.norms)
        gate, up, down = (w.data_ptr() for w in self.mlp.weights)
        entry = self.mlp.lib.kvrelay_layer_tail_amx if self.mlp.tiled else self.mlp.lib.kvrelay_layer_tail
        status = entry(
            attn.data_ptr(),
            self.width,
            self.o_w.data_ptr(),
            h.data_ptr(),
            rows,
            hidden,
            post_attn,
            pre_ff,
            post_ff,
            self.eps,
            int(self.unit_offset),
            gate,
            up,
            inner,
            down,
            self.mlp.code,
            scratch.data_ptr(),
            None if head is None else ctypes.addressof(head),
        )
        return h if status == 0 else None
