"""Incremental detokenization that never splits a multi-byte character.

``IncrementalText.push(tokens)`` returns the new text the tokens complete. As
in vLLM's detokenizer (vllm/transformers_utils/detokenizer_utils.py), it
decodes the tokens since the previous emission together with the window
before it, and emits only the part after the window's text; while the decoded
text ends with U+FFFD (a character whose bytes are not all there yet) it holds
the tail back. The concatenation of everything pushed and then flushed is the
tokens' whole text; each call decodes only the tokens since the last emission
and the window before them, never the whole output.

``text_decoder(tokenizer)`` is what each decode calls: ``tokenizer.decode(ids, skip_special_tokens=True)``,
taken from the ``tokenizers`` backend directly where transformers adds nothing to it (no clean-up of
tokenization spaces), which saves transformers' argument conversion on every relayed token
(docs/performance.md, "The router's CPU per request on vLLM engines").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

TextDecoder = Callable[[Sequence[int]], str]


def text_decoder(tokenizer: Any) -> TextDecoder:
    """``ids -> tokenizer.decode(ids, skip_special_tokens=True)``, by the backend where that is the same text."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return partial(tokenizer.decode, skip_special_tokens=True)
    return partial(backend.decode, skip_special_tokens=True)


class IncrementalText:
    def __init__(self, decode: TextDecoder) -> None:
        self.decode = decode
        self.tokens: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, tokens: Sequence[int]) -> str:
        self.tokens.extend(tokens)
        prefix = self.decode(self.tokens[self._prefix_offset : self._read_offset])
        full = self.decode(self.tokens[self._prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        new = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.tokens)
        return new

    def flush(self) -> str:
        """At the end of the stream: whatever ``push`` held back (an incomplete character decodes as U+FFFD)."""
        prefix = self.decode(self.tokens[self._prefix_offset : self._read_offset])
        full = self.decode(self.tokens[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self.tokens)
        return full[len(prefix) :]
