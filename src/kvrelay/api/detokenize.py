"""Incremental detokenization that never splits a multi-byte character.

``IncrementalText.push(tokens)`` returns the new text the tokens complete. As
in vLLM's detokenizer (vllm/transformers_utils/detokenizer_utils.py), it
decodes the tokens since the previous emission together with the window
before it, and emits only the part after the window's text; while the decoded
text ends with U+FFFD (a character whose bytes are not all there yet) it holds
the tail back. The concatenation of everything pushed and then flushed is the
tokens' whole text; each call decodes only the tokens since the last emission
and the window before them, never the whole output.
"""

from __future__ import annotations

from typing import Any


class IncrementalText:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, tokens: list[int] | tuple[int, ...]) -> str:
        self.tokens.extend(tokens)
        prefix = self.tokenizer.decode(self.tokens[self._prefix_offset : self._read_offset], skip_special_tokens=True)
        full = self.tokenizer.decode(self.tokens[self._prefix_offset :], skip_special_tokens=True)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        new = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.tokens)
        return new

    def flush(self) -> str:
        """At the end of the stream: whatever ``push`` held back (an incomplete character decodes as U+FFFD)."""
        prefix = self.tokenizer.decode(self.tokens[self._prefix_offset : self._read_offset], skip_special_tokens=True)
        full = self.tokenizer.decode(self.tokens[self._prefix_offset :], skip_special_tokens=True)
        self._prefix_offset = self._read_offset = len(self.tokens)
        return full[len(prefix) :]
