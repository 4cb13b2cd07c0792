"""Next-token choice: greedy, temperature, top-k, top-p, seeded per (seed, position); stop rules.

Every sampled draw uses one uniform number derived only from the request's
``seed`` and the absolute position of the token being drawn (a splitmix64
hash), then inverts a CDF: that of the filtered distribution sorted by
probability when top-k or top-p is on, that of the whole vocabulary in id
order when neither is (no sort of the vocabulary per row). Nothing depends on
the other rows of the batch or on any generator state, so the same request and
seed draw the same tokens on any worker of one device type, in any batch, and
when a continuation resumes at a later position (docs/design.md section 6); logits
that differ in their last bits (another device kind) can still move a draw
across a CDF boundary. ``temperature == 0`` is greedy (argmax, lowest id on ties).

Filters follow transformers' warpers, in their order: temperature, then top-k
(``top_k == 0``: off), then top-p over the renormalized top-k distribution (the
smallest prefix of the sorted distribution whose mass reaches ``top_p``; the
most likely token always stays).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch

from kvrelay.protocol.messages import Sampling

_MASK64 = (1 << 64) - 1
NUCLEUS_PROBES = (64, 1024)
"""Top-p tries these many most likely tokens in turn; it sorts the vocabulary only if none holds the mass."""


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform_draw(seed: int, position: int) -> float:
    """A number in ``[0, 1)`` fixed by ``(seed, position)`` alone."""
    mixed = _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64))
    return (mixed >> 11) * 2.0**-53


def sample_next(logits: torch.Tensor, params: Sequence[Sampling], positions: Sequence[int]) -> list[int]:
    """One token per row of ``logits`` (``[B, vocab]``, float32 or bfloat16), row ``i`` under ``params[i]``.

    Greedy rows take the argmax of the logits as given (bfloat16 values convert to
    float32 exactly, so the choice is the same either way); sampled rows convert to float32.

    ``positions[i]`` is the absolute position the drawn token will occupy.
    """
    if logits.dim() != 2 or not (logits.shape[0] == len(params) == len(positions)):
        raise ValueError(
            f"sample_next needs logits [B, vocab] with B == len(params) == len(positions); "
            f"got {tuple(logits.shape)}, {len(params)}, {len(positions)}"
        )
    tokens = [0] * len(params)
    greedy = [i for i, p in enumerate(params) if p.temperature == 0.0]
    if greedy:
        rows = logits if len(greedy) == len(params) else logits[greedy]
        chosen = greedy_tokens(rows).tolist()
        for i, token in zip(greedy, chosen, strict=True):
            tokens[i] = int(token)
    for i, p in enumerate(params):
        if p.temperature != 0.0:
            tokens[i] = sample_row(logits[i], p, uniform_draw(p.seed, positions[i]))
    return tokens


def greedy_tokens(logits: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """``logits.argmax(-1)`` (the lowest id among equal maxima), computed blockwise.

    Takes the first block holding the row maximum, then the first maximum inside it:
    on CPU ``argmax`` over a large vocabulary is much slower than ``amax``
    (docs/performance.md, "Blockwise greedy argmax"; ``tests/unit/test_sampling.py``).
    """
    rows, vocab = logits.shape
    if vocab <= 4 * block:
        return logits.argmax(dim=-1)
    whole = vocab - vocab % block
    block_max = logits[:, :whole].reshape(rows, whole // block, block).amax(dim=-1)
    if whole < vocab:
        block_max = torch.cat([block_max, logits[:, whole:].amax(dim=-1, keepdim=True)], dim=1)
    starts = block_max.argmax(dim=-1) * block
    index = starts.unsqueeze(1) + torch.arange(block, device=logits.device)
    inside = logits.gather(1, index.clamp(max=vocab - 1)).masked_fill(index >= vocab, -math.inf)
    return starts + inside.argmax(dim=-1)


def sample_row(row: torch.Tensor, params: Sampling, u: float) -> int:
    """The token of ``row`` (``[vocab]`` logits) whose CDF interval, under ``params``, holds ``u``."""
    scaled = row.float() / params.temperature
    vocab = scaled.shape[0]
    top_k = params.top_k if 0 < params.top_k < vocab else vocab
    if top_k == vocab and params.top_p >= 1.0:
        probs = torch.softmax(scaled, dim=-1)
        return _invert_cdf(probs, u)
    values, ids = _most_likely(scaled, top_k, params.top_p)
    probs = torch.softmax(values, dim=-1)
    if params.top_p < 1.0:
        mass_before = probs.cumsum(0) - probs
        kept = max(1, int((mass_before < params.top_p).sum()))
        probs = probs[:kept]
    return int(ids[_invert_cdf(probs, u)])


def _most_likely(scaled: torch.Tensor, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``top_k`` largest logits, sorted; under top-p alone, a prefix known to hold the nucleus."""
    vocab = scaled.shape[0]
    if top_k == vocab and top_p < 1.0:
        total = torch.logsumexp(scaled, 0)
        for probe in (n for n in NUCLEUS_PROBES if n < vocab):
            values, ids = torch.topk(scaled, probe)
            if float(torch.exp(torch.logsumexp(values, 0) - total)) >= top_p:
                return values, ids
        return torch.sort(scaled, descending=True)
    if top_k == vocab:
        return torch.sort(scaled, descending=True)
    return torch.topk(scaled, top_k)


def _invert_cdf(probs: torch.Tensor, u: float) -> int:
    cdf = probs.cumsum(0)
    target = torch.tensor([u], dtype=cdf.dtype, device=cdf.device) * cdf[-1]
    return min(int(torch.searchsorted(cdf, target, right=True)), probs.shape[0] - 1)


FinishReason = Literal["stop", "length"]


def finish_reason(token: int, generated: int, params: Sampling, max_new_tokens: int) -> FinishReason | None:
    """Why generation ends after ``token`` (the ``generated``-th new token), or None to go on.

    A stop token wins over the length limit; the stop token itself is part of the output.
    """
    if token in params.stop_token_ids:
        return "stop"
    if generated >= max_new_tokens:
        return "length"
    return None
