"""Text prompts for Mooncake trace requests that tokenize to an exact, block-structured token sequence.

Scaling (the trace was recorded for large models on GPUs; this replays it on a
small model on a CPU): a trace block of ``trace_block_tokens`` (512) tokens
becomes ``block_tokens`` (default 16) tokens here, so a request of
``input_length`` tokens becomes ``ceil(input_length * block_tokens /
trace_block_tokens)`` tokens, capped at ``max_prompt_tokens``; generation is
capped at ``max_output_tokens``; arrival times are the trace's relative
timestamps times ``time_stretch`` (2.0: half the trace's rate).

Contract of ``PromptBuilder``:
- block ``h`` is ``block_tokens`` words drawn by a generator seeded with ``h``
  from a fixed list of words that are each exactly one token of the tokenizer
  (with a leading space), so equal ids give equal token blocks;
- a request's text is its blocks' words, each preceded by one space, cut to its
  scaled length; the tokenizer turns it into exactly one token per word (after
  its special prefix tokens, e.g. ``<bos>``); ``build`` checks this and raises
  ``PromptError`` naming the request when it does not hold;
- two requests whose first k hash ids are equal share their first
  ``k * block_tokens`` tokens (so also their text prefix, which is what a
  text-matching router such as sglang-router's ``cache_aware`` compares).
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvrelay.sim.trace import TraceError, TraceRequest, load_trace, trace_slice

_WORD = re.compile(r"[a-z]{3,10}")
_SPACE_MARKS = ("\u2581", "\u0120")
"""How tokenizers spell a leading space inside a token: SentencePiece's "▁", byte-level BPE's "Ġ"."""


class PromptError(ValueError):
    """Prompts cannot be made token-exact with this tokenizer; the message names the request or the fix."""


@dataclass(frozen=True, slots=True)
class Scaling:
    """How the trace is shrunk to this machine (see the module docstring)."""

    block_tokens: int = 16
    trace_block_tokens: int = 512
    max_prompt_tokens: int = 2048
    max_output_tokens: int = 16
    time_stretch: float = 2.0

    def prompt_words(self, r: TraceRequest) -> int:
        return min(self.max_prompt_tokens, math.ceil(r.input_length * self.block_tokens / self.trace_block_tokens))

    def output_tokens(self, r: TraceRequest) -> int:
        return min(self.max_output_tokens, r.output_length)

    def arrival_s(self, r: TraceRequest, first: TraceRequest) -> float:
        return (r.timestamp_ms - first.timestamp_ms) / 1000.0 * self.time_stretch


@dataclass(frozen=True, slots=True)
class TracePrompt:
    """One trace request, ready to send: its text, its token ids as the server will see them, its budget."""

    index: int
    line: int
    arrival_s: float
    text: str
    token_ids: tuple[int, ...]
    max_tokens: int


def single_token_words(tokenizer: Any, limit: int = 2048) -> tuple[str, ...]:
    """Up to ``limit`` lowercase words, lowest token id first, that encode (with a leading space) to one token."""
    vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    words: list[str] = []
    for token_id, piece in enumerate(vocab):
        if not piece or piece[0] not in _SPACE_MARKS or not _WORD.fullmatch(piece[1:]):
            continue
        if list(tokenizer.encode(" " + piece[1:], add_special_tokens=False)) == [token_id]:
            words.append(piece[1:])
            if len(words) >= limit:
                break
    if len(words) < 8:
        raise PromptError(
            f"the tokenizer has only {len(words)} single-token lowercase words with a leading space; "
            "token-exact trace prompts need at least 8 (use a tokenizer with a word-level vocabulary)"
        )
    return tuple(words)


class PromptBuilder:
    """Builds ``TracePrompt``s for a tokenizer (see the module contract)."""

    def __init__(self, tokenizer: Any, scaling: Scaling) -> None:
        self.tokenizer = tokenizer
        self.scaling = scaling
        self.words = single_token_words(tokenizer)
        self.prefix = tuple(tokenizer.encode("", add_special_tokens=True))
        self._blocks: dict[int, tuple[str, ...]] = {}

    def block(self, block_id: int) -> tuple[str, ...]:
        """The words of block ``block_id`` (a pure function of the id and the word list)."""
        words = self._blocks.get(block_id)
        if words is None:
            rng = random.Random(block_id)
            words = self._blocks[block_id] = tuple(rng.choice(self.words) for _ in range(self.scaling.block_tokens))
        return words

    def words_of(self, r: TraceRequest) -> list[str]:
        n = self.scaling.prompt_words(r)
        out: list[str] = []
        for h in r.hash_ids:
            if len(out) >= n:
                break
            out.extend(self.block(h))
        return out[:n]

    def build(self, requests: Sequence[TraceRequest]) -> list[TracePrompt]:
        """The prompts of ``requests`` (in order; arrivals relative to the first); checks token exactness."""
        if not requests:
            return []
        first = requests[0]
        out: list[TracePrompt] = []
        for index, r in enumerate(requests):
            words = self.words_of(r)
            text = "".join(" " + w for w in words)
            ids = tuple(self.tokenizer.encode(text, add_special_tokens=True))
            if len(ids) != len(self.prefix) + len(words) or ids[: len(self.prefix)] != self.prefix:
                raise PromptError(
                    f"trace line {r.line}: {len(words)} words tokenized to {len(ids)} tokens "
                    f"(expected {len(self.prefix) + len(words)}); this tokenizer merges across words"
                )
            out.append(
                TracePrompt(index, r.line, self.scaling.arrival_s(r, first), text, ids, self.scaling.output_tokens(r))
            )
        return out


def slice_prompts(trace: Path, offset: int, count: int, tokenizer: Any, scaling: Scaling) -> list[TracePrompt]:
    """The prompts of requests ``offset`` to ``offset + count - 1`` of the Mooncake-format ``trace`` file;
    ``TraceError`` naming the file where it cannot be read or holds fewer requests."""
    try:
        requests = trace_slice(load_trace(trace), offset, count)
    except TraceError as exc:
        raise TraceError(f"{trace}: {exc}") from None
    return PromptBuilder(tokenizer, scaling).build(requests)
