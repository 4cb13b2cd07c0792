"""Incremental detokenization and stop strings."""

from __future__ import annotations

import pytest

from kvrelay.api.detokenize import IncrementalText
from kvrelay.api.stop_strings import cut_at_stop
from kvrelay.models.loading.loader import load_artifacts
from kvrelay.testing.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    return load_artifacts(make_tiny_model("llama", tmp_path_factory.mktemp("tok"))).tokenizer


def test_pushes_concatenate_to_the_full_text_and_never_split_a_character(tokenizer) -> None:  # type: ignore[no-untyped-def]
    text = "naïve café — 東京 🚀 done"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalText(tokenizer)
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
