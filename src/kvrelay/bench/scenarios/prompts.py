"""Synthetic prompts (token ids) for the scenarios, drawn from one seeded generator.

Token ids are drawn uniformly from ``[low, high)`` of the model's vocabulary,
above its special tokens, so two independently drawn sequences never share a
chunk. ``ScenarioPrompts`` fixes, from its seed: ``prefixes`` (one per request,
the cold case's distinct prefixes), ``shared`` (the resident prefix) and
``suffixes`` (one per request, appended to ``shared``); ``fresh`` draws new ids.
"""

from __future__ import annotations

import random


def token_range(vocab_size: int) -> tuple[int, int]:
    """Ids clear of the special tokens at the bottom of a vocabulary and of the reserved ones at its top."""
    return min(1000, vocab_size // 4), min(vocab_size, 100_000)


class ScenarioPrompts:
    def __init__(self, seed: int, vocab_size: int, requests: int, prefix_tokens: int, suffix_tokens: int) -> None:
        self._rng = random.Random(seed)
        self.low, self.high = token_range(vocab_size)
        if self.high - self.low < 16:
            raise ValueError(f"a vocabulary of {vocab_size} tokens is too small to draw distinct prompts from")
        self.prefix_tokens = prefix_tokens
        self.suffix_tokens = suffix_tokens
        self.prefixes = [self.fresh(prefix_tokens) for _ in range(requests)]
        self.shared = self.fresh(prefix_tokens)
        self.suffixes = [self.fresh(suffix_tokens) for _ in range(requests)]

    def fresh(self, n: int) -> list[int]:
        """``n`` new token ids."""
        return [self._rng.randrange(self.low, self.high) for _ in range(n)]

    def on_shared(self, j: int) -> list[int]:
        """The shared prefix with the ``j``-th suffix (the same prompt every time it is asked for)."""
        return self.shared + self.suffixes[j]

    def on_prefixes(self) -> list[list[int]]:
        """Each request's own prefix with a new suffix."""
        return [p + self.fresh(self.suffix_tokens) for p in self.prefixes]

    def half_shared(self) -> list[list[int]]:
        """Prompts sharing the first half of the shared prefix, then new ids to the same length."""
        half = self.prefix_tokens // 2
        return [self.shared[:half] + self.fresh(self.prefix_tokens - half + self.suffix_tokens) for _ in self.prefixes]
