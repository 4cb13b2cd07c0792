"""Chunk keys follow docs/design.md section 4 exactly; committed vectors pin the definition."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvrelay.protocol.chunk_keys import cacheable_chunks, chunk_chain, prompt_chain, root_key

VECTORS = json.loads((Path(__file__).parent.parent / "data" / "chunk_key_vectors.json").read_text())["cases"]


@pytest.mark.parametrize(
    "case", VECTORS, ids=lambda c: f"{c['fingerprint_hex'][:8]}-{len(c['tokens'])}-{c['chunk_tokens']}"
)
def test_committed_vectors(case: dict) -> None:
    keys = chunk_chain(bytes.fromhex(case["fingerprint_hex"]), case["tokens"], case["chunk_tokens"])
    assert [k.hex() for k in keys] == case["expected_keys_hex"]


def test_prompt_chain_leaves_the_last_token_to_compute() -> None:
    fp = b"fp"
    assert cacheable_chunks(64, 64) == 0
    assert cacheable_chunks(65, 64) == 1
    assert prompt_chain(fp, list(range(64)), 64) == ()
    assert prompt_chain(fp, list(range(65)), 64) == chunk_chain(fp, list(range(65)), 64)


def test_keys_chain_on_every_earlier_token() -> None:
    fp = b"fp"
    a = chunk_chain(fp, [1] * 128, 64)
    b = chunk_chain(fp, [2] + [1] * 127, 64)
    assert a[0] != b[0] and a[1] != b[1]
    assert chunk_chain(b"other", [1] * 128, 64)[0] != a[0]
    assert a[0] != root_key(fp)
