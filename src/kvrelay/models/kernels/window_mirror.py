"""Per-lane rings of sliding-window keys and values: batched decode attention without gathers.

A decoding sequence reads, in every sliding layer, only its last ``window``
positions. ``WindowMirror`` keeps them for each runtime lane in a ring per
sliding layer, shaped ``[lanes, kv_heads, window, head_dim]`` (position ``p`` at
ring slot ``p % window``; rope is already applied, so slot order does not
matter to attention). One batched ``decode_attention`` per layer then
reads every decoding lane's window in place: one pass over the keys per step,
instead of gathering scattered pages into a buffer and reading that again. On a
CPU with AVX-512 BF16 that read is the C kernel of ``native_attention``.

The pages stay the source of truth. A lane's ring is valid for one
``LaneRef.owner`` of one pool up to a length; a decode row whose lane holds another owner,
or a length the mirror did not write, has its ring rebuilt from its pages
before the step (once per job in practice). Each decode step writes its new
key and value to the pages and to the ring. Rows without a lane, and prefill
rows, use paged attention; so do full-attention layers.

Masks: ring slot ``j`` of a sequence of ``s`` tokens holds a visible position
iff ``j < min(s, window)``: the ring holds positions ``max(0, s - window) ..
s - 1``, exactly the sliding window of the query at ``s - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrelay.models.batch import ForwardBatch
from kvrelay.models.kernels.attention import decode_attention
from kvrelay.models.kernels.huge_pages import huge_page_zeros
from kvrelay.models.kernels.kv_pages import KVPages
from kvrelay.models.kernels.native.attention import decode_attention_native


@dataclass(frozen=True, slots=True)
class MirrorStep:
    """The mirrored decode rows of one forward.

    ``rows`` (``[n]``) are token rows of the batch, or ``None`` when they are all
    rows in order; their lanes lie in ``lo .. hi - 1``, at ``lane_rows`` (``lane -
    lo``) or in order (``None``: the rows are exactly lanes ``lo .. hi - 1``).
    ``write_index`` (``[n * kv_heads]``) is where each row's new key and value go
    in a ring flattened to ``[lanes * kv_heads * window, head_dim]``; ``mask`` is
    ``[hi - lo, 1, 1, window]``, additive; ``visible`` (``[hi - lo]``, on the CPU) the
    count of leading ring slots it leaves visible per lane.
    """

    rows: torch.Tensor | None
    lo: int
    hi: int
    lane_rows: torch.Tensor | None
    write_index: torch.Tensor
    mask: torch.Tensor
    visible: torch.Tensor
    seqs: frozenset[int]


class WindowMirror:
    """The rings of one model's sliding layers (``layers``: their ids), grown to the lanes seen.

    Not thread-safe: one model step at a time uses it (as ``PagedModel.forward``).
    """

    def __init__(self, layers: list[int], kv_heads: int, head_dim: int, window: int) -> None:
        self.ring_of_layer = {layer: i for i, layer in enumerate(layers)}
        self.kv_heads, self.head_dim, self.window = kv_heads, head_dim, window
        self.k = torch.empty(0)
        self.v = torch.empty(0)
        self._valid: dict[int, tuple[int, int]] = {}
        """Lane slot -> (owner, tokens mirrored), for the pool ``_pool``."""
        self._pool: torch.Tensor | None = None

    def prepare(self, batch: ForwardBatch, kv: KVPages, dtype: torch.dtype) -> MirrorStep | None:
        """Rebuild stale rings of ``batch``'s laned decode rows from ``kv`` and plan their step.

        ``None`` when no row qualifies. Marks the lanes as mirrored up to this step's
        length; call ``forget`` if the step fails.
        """
        if batch.lanes is None or not self.ring_of_layer:
            return None
        chosen = [i for i, (q, lane) in enumerate(zip(batch.query_lens, batch.lanes)) if q == 1 and lane is not None]
        if not chosen:
            return None
        slots = [batch.lanes[i].slot for i in chosen]  # type: ignore[union-attr]
        if len(set(slots)) != len(slots) or min(slots) < 0:
            raise ValueError(f"decode rows need distinct lane slots >= 0; got {slots}")
        self._reserve(max(slots) + 1, kv)
        stale = []
        for i, slot in zip(chosen, slots):
            owner, length = batch.lanes[i].owner, batch.seq_lens[i]  # type: ignore[union-attr]
            if self._valid.pop(slot, None) != (owner, length - 1):
                stale.append(i)
        if stale:
            self._rebuild(batch, kv, stale)
        for i, slot in zip(chosen, slots):
            self._valid[slot] = (batch.lanes[i].owner, batch.seq_lens[i])  # type: ignore[union-attr]
        return self._plan(batch, chosen, slots, dtype, kv.device)

    def forget(self, step: MirrorStep | None) -> None:
        """Drop every lane of ``step`` (its forward failed, so its rings may be half written)."""
        if step is not None:
            for slot in range(step.lo, step.hi):
                self._valid.pop(slot, None)

    def write(self, layer: int, step: MirrorStep, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the step's new keys and values (``[T, kv_heads, head_dim]``, all rows) of sliding ``layer``."""
        ring = self.ring_of_layer[layer]
        if step.rows is not None:
            k, v = k.index_select(0, step.rows), v.index_select(0, step.rows)
        flat = (-1, self.head_dim)
        self.k[ring].view(flat).index_copy_(0, step.write_index, k.reshape(flat).to(self.k.dtype))
        self.v[ring].view(flat).index_copy_(0, step.write_index, v.reshape(flat).to(self.v.dtype))

    def attend(self, layer: int, step: MirrorStep, q: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention ``[n, heads, head_dim]`` of the mirrored rows' queries ``q`` (``[n, heads, head_dim]``)."""
        ring = self.ring_of_layer[layer]
        _, heads, head_dim = q.shape
        lanes = step.hi - step.lo
        if step.lane_rows is not None:
            full = q.new_zeros(lanes, heads, head_dim)
            q = full.index_copy_(0, step.lane_rows, q)
        queries = q.view(lanes, self.kv_heads, heads // self.kv_heads, head_dim)
        k = self.k[ring, step.lo : step.hi].to(q.dtype)
        v = self.v[ring, step.lo : step.hi].to(q.dtype)
        out = decode_attention_native(queries, k, v, step.visible, scale)
        if out is None:
            out = decode_attention(queries, k, v, step.mask, scale)
        out = out.reshape(lanes, heads, head_dim)
        return out if step.lane_rows is None else out.index_select(0, step.lane_rows)

    def _reserve(self, lanes: int, kv: KVPages) -> None:
        """Rings for at least ``lanes`` lanes of ``kv``'s dtype and device, tied to ``kv``'s pool."""
        if self._pool is not kv.k:
            self._valid.clear()
            self._pool = kv.k
        same = self.k.dim() == 5 and self.k.dtype == kv.dtype and self.k.device == kv.device
        if same and self.k.shape[1] >= lanes:
            return
        grown = max(lanes, 2 * self.k.shape[1]) if same else lanes
        shape = (len(self.ring_of_layer), grown, self.kv_heads, self.window, self.head_dim)
        k = huge_page_zeros(shape, kv.dtype, kv.device)
        v = huge_page_zeros(shape, kv.dtype, kv.device)
        if same:
            k[:, : self.k.shape[1]] = self.k
            v[:, : self.v.shape[1]] = self.v
        else:
            self._valid.clear()
        self.k, self.v = k, v

    def _rebuild(self, batch: ForwardBatch, kv: KVPages, stale: list[int]) -> None:
        """Copy positions ``max(0, s - window) .. s - 2`` of each stale row's sequence from its pages."""
        page_tokens = kv.page_tokens
        positions: list[int] = []
        seq_of: list[int] = []
        slot_of: list[int] = []
        for i in stale:
            last = batch.seq_lens[i] - 1
            span = range(max(0, last - self.window + 1), last)
            positions.extend(span)
            seq_of.extend([i] * len(span))
            slot_of.extend([batch.lanes[i].slot] * len(span))  # type: ignore[index, union-attr]
        if not positions:
            return
        pos = torch.tensor(positions, dtype=torch.long)
        tables = batch.page_tables.to("cpu", torch.long)
        pool_rows = tables[torch.tensor(seq_of), pos // page_tokens] * page_tokens + pos % page_tokens
        ring_rows = self._ring_index(torch.tensor(slot_of), pos)
        pool_rows, ring_rows = pool_rows.to(kv.device), ring_rows.to(kv.device)
        flat = (-1, self.head_dim)
        for layer, ring in self.ring_of_layer.items():
            for pool, mirror in ((kv.k, self.k), (kv.v, self.v)):
                src = pool[layer].view(-1, self.kv_heads, self.head_dim).index_select(0, pool_rows)
                mirror[ring].view(flat).index_copy_(0, ring_rows, src.reshape(flat))

    def _ring_index(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rows ``[n * kv_heads]`` of the flattened ring for (lane slot, position) pairs, heads innermost."""
        heads = torch.arange(self.kv_heads)
        lane_head = slots.unsqueeze(1) * self.kv_heads + heads
        return (lane_head * self.window + (positions % self.window).unsqueeze(1)).flatten()

    def _plan(
        self, batch: ForwardBatch, chosen: list[int], slots: list[int], dtype: torch.dtype, device: torch.device
    ) -> MirrorStep:
        starts = torch.tensor(batch.query_lens).cumsum(0) - 1
        rows = starts[chosen]
        lo, hi = min(slots), max(slots) + 1
        slot_t = torch.tensor(slots, dtype=torch.long)
        in_order = slots == list(range(lo, hi))
        all_rows = len(chosen) == batch.num_seqs and batch.num_tokens == batch.num_seqs
        visible = torch.ones(hi - lo, dtype=torch.long)
        visible[slot_t - lo] = torch.tensor([batch.seq_lens[i] for i in chosen]).clamp(max=self.window)
        mask = torch.zeros(hi - lo, 1, 1, self.window, dtype=dtype)
        mask.masked_fill_(torch.arange(self.window) >= visible.view(-1, 1, 1, 1), float("-inf"))
        positions = torch.tensor([batch.seq_lens[i] - 1 for i in chosen], dtype=torch.long)
        return MirrorStep(
            rows=None if all_rows else rows.to(device),
            lo=lo,
            hi=hi,
            lane_rows=None if in_order else (slot_t - lo).to(device),
            write_index=self._ring_index(slot_t, positions).to(device),
            mask=mask.to(device),
            visible=visible,
            seqs=frozenset(chosen),
        )
