"""Building blocks shared by the architecture adapters: weights, norms, rope, paged self-attention.

Numerics follow transformers' ``modeling_llama.py`` and ``modeling_gemma3.py``
step by step (same casts, same order), so float32 logits match to rounding.
The q, k and v projections are fused into one at build time; q and k are
normed and rotated as one tensor. In bfloat16 on CPU, projections and the LM
head are ``mlp.PackedLinear``s, norms (with the rope after the q/k norm, and
the residual add after Gemma's output norms) run in ``native.rms_norm``,
sliding layers of laned decode rows read ``window_mirror`` rings, and a single
greedy row takes its token from ``greedy_head``. The MLP block is
``mlp.GatedMLP``. On a CPU with AVX-512 BF16 a decode step's rows (up to 32)
take a layer's work after its attention in one kernel call (``decode_tail``), which also computes
the next layer's q, k, v where ``link_tails`` linked the two
(``attention_then_tail``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from kvrelay.models.batch import ForwardBatch
from kvrelay.models.config import ModelConfig
from kvrelay.models.kernels import native
from kvrelay.models.kernels.attention import GatherBuffers, paged_attention
from kvrelay.models.kernels.attention_plan import AttentionPlan, plan_attention
from kvrelay.models.kernels.greedy_head import GreedyHead
from kvrelay.models.kernels.kv_pages import KVPages, write_kv
from kvrelay.models.kernels.native.mlp_rows import LayerTail
from kvrelay.models.kernels.native.rms_norm import add_rms_norm_native, rms_norm_native
from kvrelay.models.kernels.window_mirror import MirrorStep, WindowMirror
from kvrelay.models.mlp import GatedMLP, PackedLinear
from kvrelay.models.sampled_rows import SampledRows, sampled_rows
from kvrelay.models.sampling import greedy_tokens
from kvrelay.models.weights import Weights


class RMSNorm:
    """RMS norm over the last dim, computed in float32 as transformers does: ``x * rsqrt(mean(x^2) + eps)``.

    ``unit_offset=True`` is Gemma's ``(x_hat * (1 + w)).to(dtype)``; otherwise
    Llama's ``w * x_hat.to(dtype)``. ``weight`` may have leading dims that
    broadcast against the input's (per-head weights of a fused q/k norm).
    bfloat16 rows on a CPU with AVX-512 BF16 go through ``native.rms_norm``.
    """

    def __init__(self, weight: torch.Tensor, eps: float, unit_offset: bool) -> None:
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = (1.0 + weight.float()) if unit_offset else weight
        self.kernel_weight = self.weight.float().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        normed = rms_norm_native(x, self.kernel_weight, self.eps, self.unit_offset)
        if normed is not None:
            return normed
        xf = x.float()
        x_hat = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True).add_(self.eps))
        if self.unit_offset:
            return x_hat.mul_(self.weight).to(x.dtype)
        return self.weight * x_hat.to(x.dtype)

    def then_rope(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """``apply_rope(self(x), cos, signed_sin)``."""
        rotated = rms_norm_native(x, self.kernel_weight, self.eps, self.unit_offset, rope=(cos, signed_sin))
        return rotated if rotated is not None else apply_rope(self(x), cos, signed_sin)

    def add_to(self, base: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``base.add_(self(x))``: ``base`` plus the norm of ``x``, in place, returned."""
        if add_rms_norm_native(base, x, self.kernel_weight, self.eps, self.unit_offset):
            return base
        return base.add_(self(x))


class Rotary:
    """Rotary position embedding (default rope type) of ``head_dim`` with base ``theta``."""

    def __init__(self, head_dim: int, theta: float, device: torch.device) -> None:
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=device) / head_dim))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and signed ``sin`` tables ``[T, 1, head_dim]`` for absolute ``positions`` ``[T]``.

        The first half of the ``sin`` table is negated (``apply_rope`` swaps halves without negating).
        """
        freqs = positions.unsqueeze(-1).float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
        sin = emb.sin()
        sin[..., : freqs.shape[-1]].neg_()
        return emb.cos().to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (``[T, heads, head_dim]``) by the half-split convention of transformers.

    ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``, computed as
    ``x * cos + cat(x2, x1) * signed_sin``: the same products (negation is exact), one copy fewer.
    """
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return (x * cos).add_(swapped.mul_(signed_sin))


@dataclass(frozen=True, slots=True)
class StepContext:
    """What every layer of one forward pass shares: the plan, the pool, rope tables per layer type, gather
    space, and the window mirror with its plan for this step (``None`` when no row uses it)."""

    plan: AttentionPlan
    kv: KVPages
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]
    buffers: GatherBuffers
    mirror: WindowMirror | None = None
    mirror_step: MirrorStep | None = None
    handoff: dict[int, torch.Tensor] = field(default_factory=dict)
    """A layer's q, k, v rows (q and k normed and rotated) that the layer before it computed in its tail
    (``LayerTail.through_next``), by layer index; each is taken once."""
    sampled: SampledRows | None = None
    """The rows the last layer finishes alone after writing every row's keys and values (``sampled_rows``)."""


class PagedSelfAttention:
    """Fused QKV projection, optional QK RMS norm, rope, paged attention, output projection.

    ``qk_norm_unit_offset`` selects Gemma's ``1 + w`` convention for the QK norms.
    """

    def __init__(
        self, w: Weights, prefix: str, config: ModelConfig, layer: int, qk_norm_unit_offset: bool = False
    ) -> None:
        hidden, d = config.hidden_size, config.head_dim
        q_out, kv_out = config.num_heads * d, config.num_kv_heads * d
        self.layer = layer
        self.layer_type = config.layer_types[layer]
        self.heads, self.kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.scale = config.attention_scale
        names = [f"{prefix}.{p}_proj" for p in ("q", "k", "v")]
        shapes = [q_out, kv_out, kv_out]
        qkv_bias = None
        if config.attention_bias:
            qkv_bias = torch.cat([w.take(f"{n}.bias", (o,)) for n, o in zip(names, shapes, strict=True)])
        self.qkv = PackedLinear(
            torch.cat([w.take(f"{n}.weight", (o, hidden)) for n, o in zip(names, shapes, strict=True)]), qkv_bias
        )
        self.o = PackedLinear(
            w.take(f"{prefix}.o_proj.weight", (hidden, q_out)), w.take_optional(f"{prefix}.o_proj.bias", (hidden,))
        )
        self.qk_norm = None
        if config.qk_norm:
            q_w, k_w = w.take(f"{prefix}.q_norm.weight", (d,)), w.take(f"{prefix}.k_norm.weight", (d,))
            per_head = torch.stack([q_w] * self.heads + [k_w] * self.kv_heads)
            self.qk_norm = RMSNorm(per_head, config.rms_norm_eps, qk_norm_unit_offset)

    def __call__(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        return self.o(self.attend(x, ctx))

    def attend(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """The attention before the output projection, ``[T, heads * D]``: q and k heads are normed and rotated
        together, as one ``[T, heads + kv_heads, D]`` tensor."""
        return self._attend_qkv(self.qkv(x), ctx, rotated=False)

    def attend_rotated(self, qkv: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """``attend`` from the q, k, v rows ``[T, (heads + 2 kv_heads) D]`` whose q and k heads are already normed and
        rotated (``StepContext.handoff``)."""
        return self._attend_qkv(qkv, ctx, rotated=True)

    def _attend_qkv(self, qkv: torch.Tensor, ctx: StepContext, rotated: bool) -> torch.Tensor:
        tokens = qkv.shape[0]
        qk_width = (self.heads + self.kv_heads) * self.head_dim
        qk = qkv[:, :qk_width].view(tokens, self.heads + self.kv_heads, self.head_dim)
        v = qkv[:, qk_width:].view(tokens, self.kv_heads, self.head_dim)
        if not rotated:
            cos, sin = ctx.rope[self.layer_type]
            qk = apply_rope(qk, cos, sin) if self.qk_norm is None else self.qk_norm.then_rope(qk, cos, sin)
        q, k = qk[:, : self.heads], qk[:, self.heads :]
        k_pool, v_pool = ctx.kv.k[self.layer], ctx.kv.v[self.layer]
        write_kv(k_pool, v_pool, ctx.plan.slots, k, v, ctx.plan.slot_run)
        sampled = ctx.sampled
        if sampled is not None and sampled.layer == self.layer:
            return self._attend_sampled(q, k_pool, v_pool, sampled, ctx.buffers)
        if self.layer_type != "sliding_attention":
            out = paged_attention(q, k_pool, v_pool, ctx.plan.full, self.scale, ctx.buffers)
        elif ctx.mirror is None or ctx.mirror_step is None:
            out = paged_attention(q, k_pool, v_pool, ctx.plan.sliding, self.scale, ctx.buffers)
        else:
            out = self._attend_mirrored(q, k, v, k_pool, v_pool, ctx, ctx.mirror, ctx.mirror_step)
        return out.reshape(tokens, -1)

    def _attend_sampled(
        self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, sampled: SampledRows, buffers: GatherBuffers
    ) -> torch.Tensor:
        """Attention ``[N, heads * head_dim]`` of the sampled rows' queries alone, one query per row."""
        if sampled.plan is None:
            return q.new_empty(0, self.heads * self.head_dim)
        plan = sampled.plan
        groups = plan.sliding if self.layer_type == "sliding_attention" else plan.full
        out = paged_attention(q.index_select(0, sampled.rows), k_pool, v_pool, groups, self.scale, buffers)
        return out.reshape(sampled.rows.shape[0], -1)

    def _attend_mirrored(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        ctx: StepContext,
        mirror: WindowMirror,
        step: MirrorStep,
    ) -> torch.Tensor:
        """Sliding attention with the mirrored decode rows read from their rings, the rest from pages."""
        mirror.write(self.layer, step, k, v)
        if step.rows is None:
            return mirror.attend(self.layer, step, q, self.scale)
        out = paged_attention(q, k_pool, v_pool, ctx.plan.sliding, self.scale, ctx.buffers)
        return out.index_copy_(0, step.rows, mirror.attend(self.layer, step, q.index_select(0, step.rows), self.scale))


def decode_tail(
    attention: PagedSelfAttention,
    mlp: GatedMLP,
    norms: tuple[RMSNorm | None, RMSNorm, RMSNorm | None],
    eps: float,
    unit_offset: bool,
) -> LayerTail | None:
    """A layer's work after its attention as one kernel call for a decode step's rows (``native.mlp_rows.LayerTail``:
    output projection, the norms as given (post-attention, pre-feedforward, post-feedforward; ``None``: none) with
    their residual adds, and the MLP); ``None`` where it does not run (no decode MLP kernel, a bias, float32)."""
    if attention.o.bias is not None or mlp.decode is None:
        return None
    weights = tuple(None if n is None else n.kernel_weight for n in norms)
    pre_ff = weights[1]
    assert pre_ff is not None
    return LayerTail.build(attention.o.weight, mlp.decode, (weights[0], pre_ff, weights[2]), eps, unit_offset)


class TailedLayer(Protocol):
    """What ``attention_then_tail`` and ``link_tails`` need of a decoder layer."""

    index: int
    input_norm: RMSNorm
    attention: PagedSelfAttention
    tail: LayerTail | None
    next_rope: str | None
    """The next layer's rope kind where this layer's tail computes its start (``link_tails``), else ``None``."""


def attention_then_tail(
    layer: TailedLayer, h: torch.Tensor, ctx: StepContext
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The rows that go on (``h``, or its sampled rows where ``ctx.sampled`` names this layer), the layer's attention
    output for them (from the rows its predecessor's tail handed over, else from ``h``), and whether its tail then
    did the rest of the layer on those rows in place (and, where linked, the next layer's start)."""
    handed = ctx.handoff.pop(layer.index, None)
    if handed is not None and handed.shape[0] == h.shape[0]:
        attended = layer.attention.attend_rotated(handed, ctx)
    else:
        attended = layer.attention.attend(layer.input_norm(h), ctx)
    sampled = ctx.sampled
    if sampled is not None and sampled.layer == layer.index:
        h = h.index_select(0, sampled.rows)
        if h.shape[0] == 0:
            return h, attended, True
    tail = layer.tail
    if tail is None:
        return h, attended, False
    if layer.next_rope is not None:
        cos, sin = ctx.rope[layer.next_rope]
        start = tail.through_next(attended, h, cos, sin)
        if start is not None:
            ctx.handoff[layer.index + 1] = start
            return h, attended, True
    return h, attended, tail(attended, h)


def link_tails(layers: Sequence[TailedLayer]) -> None:
    """Let each layer's tail also compute the next layer's start (its input norm, q, k, v projection, q and k
    norms and rope) where both run the decode kernels and the next layer norms its q and k heads."""
    for layer, after in zip(layers, layers[1:], strict=False):
        attention = after.attention
        if layer.tail is None or attention.qk_norm is None or attention.qkv.bias is not None:
            continue
        qk_heads = attention.heads + attention.kv_heads
        norm_w = attention.qk_norm.kernel_weight
        if norm_w.shape != (qk_heads, attention.head_dim) or after.input_norm.eps != layer.tail.eps:
            continue
        if layer.tail.with_next(
            after.input_norm.kernel_weight, attention.qkv.weight, qk_heads, attention.head_dim, norm_w
        ):
            layer.next_rope = attention.layer_type


DecoderLayer = Callable[[torch.Tensor, StepContext], torch.Tensor]


class PagedModel:
    """A decoder-only language model whose KV cache lives in a ``KVPages`` pool.

    Subclasses set ``layers``, ``norm`` and ``rotaries`` (per layer type), call
    ``set_lm_head``, and may override ``embed``. ``hidden`` writes the batch's new
    keys and values into their pages and returns the final normed hidden rows
    ``[len(logits_indices), hidden]``; ``logits`` turns rows into logits
    ``[rows, vocab]`` in ``logits_dtype`` (``None``: the model's dtype, which spares
    a float32 copy of the whole vocabulary per row), ``greedy`` into their greedy
    tokens (for bfloat16 rows on a CPU, through ``greedy_head`` without the
    full logits), and ``forward`` is ``logits(hidden(...))``. A step reads the
    resident prefix of every sequence from its pages, so those pages must hold
    it; pages written in the same step must not be shared between sequences.
    One thread at a time may run a step (the gather storage is reused between
    calls).
    """

    layers: list[DecoderLayer]
    norm: RMSNorm
    rotaries: dict[str, Rotary]
    embedding: torch.Tensor
    lm_head: torch.Tensor
    _head: PackedLinear
    greedy_head: GreedyHead | None
    """The exact greedy screen of the LM head; None where it does not apply (``GreedyHead.build``)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.config = config
        self.dtype = dtype
        self.device = device
        self.sliding_window = config.sliding_window if "sliding_attention" in config.layer_types else None
        self.buffers = GatherBuffers()
        self.mirror: WindowMirror | None = None
        if self.sliding_window is not None:
            sliding = [i for i, kind in enumerate(config.layer_types) if kind == "sliding_attention"]
            self.mirror = WindowMirror(sliding, config.num_kv_heads, config.head_dim, self.sliding_window)
        if dtype == torch.bfloat16 and device.type == "cpu":
            native.load_all()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embedding)

    def set_lm_head(self, w: Weights) -> None:
        """Set the output projection (the embedding when tied, else ``lm_head.weight``) and build its
        packed copy and greedy screen; needs ``embedding``."""
        if self.config.tie_word_embeddings:
            self.lm_head = self.embedding
        else:
            self.lm_head = w.take("lm_head.weight", (self.config.vocab_size, self.config.hidden_size))
        self._head = PackedLinear(self.lm_head, max_rows=None)
        self.greedy_head = GreedyHead.build(self.lm_head)

    @torch.no_grad()
    def forward(
        self, batch: ForwardBatch, kv: KVPages, logits_dtype: torch.dtype | None = torch.float32
    ) -> torch.Tensor:
        return self.logits(self.hidden(batch, kv), logits_dtype)

    @torch.no_grad()
    def hidden(self, batch: ForwardBatch, kv: KVPages) -> torch.Tensor:
        self._check_pool(kv)
        mirror_step = None if self.mirror is None else self.mirror.prepare(batch, kv, self.dtype)
        try:
            h = self._forward(batch, kv, mirror_step)
        except BaseException:
            if self.mirror is not None:
                self.mirror.forget(mirror_step)
            self.buffers.kept.clear()
            raise
        self.buffers.kept.end_step()
        return h

    @torch.no_grad()
    def logits(self, h: torch.Tensor, logits_dtype: torch.dtype | None = None) -> torch.Tensor:
        logits = self._head(h)
        return logits if logits_dtype is None else logits.to(logits_dtype)

    @torch.no_grad()
    def greedy(self, h: torch.Tensor) -> list[int]:
        """The greedy token of each row of ``h``: ``greedy_tokens(self.logits(h))``, through the greedy screen
        where it takes the rows (a row it leaves undecided gets its full logits)."""
        screen = self.greedy_head
        decided = screen.argmax_rows(h) if screen is not None else None
        if decided is None:
            return greedy_tokens(self.logits(h)).tolist()
        undecided = [i for i, token in enumerate(decided) if token is None]
        rest = iter(greedy_tokens(self.logits(h[undecided])).tolist() if undecided else [])
        return [token if token is not None else next(rest) for token in decided]

    def _forward(self, batch: ForwardBatch, kv: KVPages, mirror_step: MirrorStep | None) -> torch.Tensor:
        mirrored = frozenset() if mirror_step is None else mirror_step.seqs
        plan = plan_attention(batch, kv.page_tokens, self.sliding_window, self.device, self.dtype, mirrored)
        positions = batch.positions.to(self.device)
        rope = {kind: rotary.cos_sin(positions, self.dtype) for kind, rotary in self.rotaries.items()}
        last = len(self.layers) - 1
        sampled = sampled_rows(batch, kv.page_tokens, self.sliding_window, self.device, self.dtype, last)
        ctx = StepContext(plan, kv, rope, self.buffers, self.mirror, mirror_step, sampled=sampled)
        h = self.embed(batch.input_ids.to(self.device))
        for layer in self.layers:
            h = layer(h, ctx)
        if sampled is None:
            h = h.index_select(0, batch.logits_indices.to(self.device))
        return self.norm(h)

    def _check_pool(self, kv: KVPages) -> None:
        c = self.config
        want = (c.num_layers, c.num_kv_heads, c.head_dim)
        got = (kv.num_layers, kv.k.shape[3], kv.k.shape[4])
        if got != want:
            raise ValueError(f"KV pool shaped for (layers, kv_heads, head_dim) = {got}; this model needs {want}")
        if kv.device.type != self.device.type:
            raise ValueError(f"KV pool is on {kv.device}; this model runs on {self.device}")
