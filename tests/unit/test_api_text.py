"""Incremental detokenization and stop strings."""

from __future__ import annotations

import random

import pytest

from kvrelay.api.detokenize import IncrementalText, text_decoder
from kvrelay.api.served_model import ServedModel, encode_prompt
from kvrelay.api.stop_strings import cut_at_stop
from kvrelay.models.loading.loader import load_artifacts
from kvrelay.testing.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    return load_artifacts(make_tiny_model("llama", tmp_path_factory.mktemp("tok"))).tokenizer


@pytest.mark.parametrize("which", ["tiny", "gemma"])
def test_the_decoder_gives_transformers_text_for_any_ids(which: str, request: pytest.FixtureRequest) -> None:
    """Random ids (special tokens, bytes of split characters, unused rows) decode as ``tokenizer.decode`` with
    ``skip_special_tokens`` does, and the fast path is taken (a backend without transformers' clean-up)."""
    tok = request.getfixturevalue("tokenizer" if which == "tiny" else "gemma_tokenizer")
    decode = text_decoder(tok)
    assert decode.func == tok.backend_tokenizer.decode  # type: ignore[attr-defined]
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    vocab = len(tok)
    for _ in range(300):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(0, 12))]
        assert decode(ids) == tok.decode(ids, skip_special_tokens=True), f"seed {seed}, ids {ids}"


@pytest.mark.parametrize("which", ["tiny", "gemma"])
def test_prompts_encode_to_the_tokenizers_ids(which: str, request: pytest.FixtureRequest) -> None:
    """Random texts (letters, spaces, newlines, accents, CJK, emoji, special-token markup) get the ids of the
    backend's ``encode``, with and without special tokens."""
    tok = request.getfixturevalue("tokenizer" if which == "tiny" else "gemma_tokenizer")
    model = ServedModel("m", tok, "llama", 1 << 20)
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    pieces = ["a", "word", " ", "  ", "\n", "\n\n", "é", "naïve", "東京", "🚀", "<bos>", "<start_of_turn>", "1234", "."]
    for _ in range(100):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 60)))
        for special in (True, False):
            expected = tok.backend_tokenizer.encode(text, add_special_tokens=special).ids
            assert encode_prompt(model, text, special, "prompt") == expected, f"seed {seed}, text {text!r}"


def test_a_tokenizer_that_cleans_up_spaces_decodes_through_transformers(tokenizer) -> None:  # type: ignore[no-untyped-def]
    class CleaningUp:
        backend_tokenizer = tokenizer.backend_tokenizer
        clean_up_tokenization_spaces = True

        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            return "cleaned"

    assert text_decoder(CleaningUp())([5, 6]) == "cleaned"


def test_pushes_concatenate_to_the_full_text_and_never_split_a_character(tokenizer) -> None:  # type: ignore[no-untyped-def]
    text = "naïve café — 東京 🚀 done"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalText(text_decoder(tokenizer))
    pieces = [detok.push([t]) for t in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize(
    ("emitted", "held", "expected"),
    [
        ("", "hello world", ("hello world", False, "")),
        ("", "hello STOP more", ("hello ", True, "")),
        ("hello ST", "OP more", ("", True, "")),
        ("", "hello ST", ("hello ", False, "ST")),
    ],
)
def test_stop_strings_cut_and_hold_back(emitted: str, held: str, expected: tuple) -> None:
    assert cut_at_stop(emitted, held, ("STOP",)) == expected
