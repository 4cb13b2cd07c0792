"""Mooncake trace loading, the infinite-cache bound, and prompt/chain synthesis."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvrelay.protocol.chunk_keys import prompt_chain
from kvrelay.sim.trace import (
    SYNTHETIC_VOCAB,
    PromptSynthesizer,
    TraceError,
    TraceRequest,
    chunk_cache_bound,
    infinite_cache_bound,
    load_trace,
)

DEV_TRACE = Path(__file__).resolve().parents[2] / "data" / "traces" / "mooncake_synthetic_trace.jsonl"


def write(tmp_path: Path, lines: list[str]) -> Path:
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def line(ts: int, inp: int, out: int, ids: list[int]) -> str:
    return json.dumps({"timestamp": ts, "input_length": inp, "output_length": out, "hash_ids": ids})


def test_loads_sorted_by_timestamp_and_honours_limit(tmp_path: Path) -> None:
    p = write(tmp_path, [line(20, 5, 1, [1]), "", line(10, 9, 2, [1, 2]), line(30, 4, 1, [3])])
    got = load_trace(p, block_tokens=8)
    assert [r.line for r in got] == [3, 1, 4]
    assert got[0] == TraceRequest(3, 10.0, 9, 2, (1, 2))
    assert len(load_trace(p, block_tokens=8, limit=2)) == 2


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("{not json", "t.jsonl:2: not a JSON object"),
        ("[1, 2]", "t.jsonl:2: expected a JSON object"),
        ('{"timestamp": 1, "input_length": 3}', "t.jsonl:2: missing field(s) output_length, hash_ids"),
        (line(-1, 3, 1, [1]), "t.jsonl:2: 'timestamp' must be non-negative"),
        ('{"timestamp": 1, "input_length": "3", "output_length": 1, "hash_ids": [1]}', "'input_length' must be"),
        ('{"timestamp": 1, "input_length": 3, "output_length": 1, "hash_ids": [1.5]}', "list of 64-bit integers"),
        (line(1, 3, 1, [1 << 63]), "list of 64-bit integers"),
        (line(1, 20, 1, [1]), "t.jsonl:2: 1 hash_ids but input_length 20 at 8 tokens per block needs 3; pass"),
    ],
)
def test_malformed_lines_are_rejected_naming_the_line(tmp_path: Path, bad: str, message: str) -> None:
    p = write(tmp_path, [line(0, 3, 1, [1]), bad])
    with pytest.raises(TraceError) as info:
        load_trace(p, block_tokens=8)
    assert message in str(info.value)


def test_missing_and_empty_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="does not exist"):
        load_trace(tmp_path / "nope.jsonl")
    with pytest.raises(TraceError, match="holds no requests"):
        load_trace(write(tmp_path, [""]))


def test_infinite_cache_bound_counts_blocks_seen_before() -> None:
    reqs = [TraceRequest(1, 0, 20, 1, (1, 2, 3)), TraceRequest(2, 1, 18, 1, (1, 2, 4)), TraceRequest(3, 2, 4, 1, (9,))]
    bound = infinite_cache_bound(reqs, block_tokens=8)
    assert (bound.units, bound.hit_units) == (7, 2)
    assert (bound.tokens, bound.hit_tokens) == (42, 16)


def test_chunk_bound_counts_routable_chunks_an_earlier_chain_held() -> None:
    # Blocks of 8 tokens, chunks of 4: a 20-token prompt routes (20 - 1) // 4 = 4 chunks.
    reqs = [
        TraceRequest(1, 0, 20, 1, (1, 2, 3)),  # chunks (1,0) (1,1) (2,0) (2,1): none seen
        TraceRequest(2, 1, 18, 1, (1, 2, 4)),  # 4 chunks, all of blocks 1 and 2: 4 hits
        TraceRequest(3, 2, 13, 1, (1, 5)),  # 3 chunks: (1,0) (1,1) hit; block 5 is new
        TraceRequest(4, 3, 9, 1, (9, 2)),  # block 2 under another prefix is other content: 0 hits
        TraceRequest(5, 4, 5, 1, (1,)),  # 1 chunk, a hit
    ]
    bound = chunk_cache_bound(reqs, block_tokens=8, chunk_tokens=4)
    assert (bound.units, bound.hit_units) == (4 + 4 + 3 + 2 + 1, 4 + 2 + 0 + 1)
    assert (bound.tokens, bound.hit_tokens) == (20 + 18 + 13 + 9 + 5, 7 * 4)
    assert bound.token_share < infinite_cache_bound(reqs, block_tokens=8).token_share


def test_dev_trace_bound_matches_its_readme() -> None:
    reqs = load_trace(DEV_TRACE)
    bound = infinite_cache_bound(reqs, 512)
    assert len(reqs) == 3993
    assert round(bound.unit_share * 100, 1) == 64.0
    assert round(bound.token_share * 100, 1) == 65.1
    assert chunk_cache_bound(reqs, 512, 64).token_share < bound.token_share


@pytest.mark.parametrize(
    "ids",
    [(5, 5 + SYNTHETIC_VOCAB), (0, SYNTHETIC_VOCAB**2), (-1, 1), (-(1 << 63), (1 << 63) - 1), (3, -3)],
)
def test_synthesis_is_injective_on_block_ids(ids: tuple[int, int]) -> None:
    """Distinct block ids give distinct tokens from the first chunk on, so distinct chunk keys
    (the old synthesis repeated itself every SYNTHETIC_VOCAB ids)."""
    syn = PromptSynthesizer(b"fp", block_tokens=128, chunk_tokens=64)
    a, b = (syn.block_tokens_of(h) for h in ids)
    assert a[:64].tolist() != b[:64].tolist()
    assert int(max(a.max(), b.max())) < SYNTHETIC_VOCAB and int(min(a.min(), b.min())) >= 0
    ra, rb = (TraceRequest(i, 0, 300, 1, (7, h, 8)) for i, h in enumerate(ids))
    ca, cb = syn.chain(ra), syn.chain(rb)
    assert ca[:2] == cb[:2] and not set(ca[2:]) & set(cb[2:])


def test_synthesized_chain_is_the_key_rule_over_the_synthesized_prompt() -> None:
    syn = PromptSynthesizer(b"fp", block_tokens=128, chunk_tokens=64)
    a = TraceRequest(1, 0, 300, 5, (7, 8, 9))
    b = TraceRequest(2, 0, 257, 5, (7, 8, 11))
    pa, pb = syn.prompt(a), syn.prompt(b)
    assert len(pa) == 300 and pa[:256] == pb[:256] and pa[256:] != pb[256:257]
    assert syn.chain(a) == prompt_chain(b"fp", pa, 64)
    assert syn.chain(b) == prompt_chain(b"fp", pb, 64)
    assert len(syn.chain(a)) == 4 and syn.chain(a)[:4] == syn.chain(b)[:4]
    req = syn.request(a, "r1", "m")
    assert req.chain == syn.chain(a) and req.max_new_tokens == 5 and req.sampling.seed == 1


def test_block_size_must_be_a_multiple_of_the_chunk() -> None:
    with pytest.raises(TraceError, match="not a multiple of chunk_tokens 64"):
        PromptSynthesizer(b"fp", block_tokens=100, chunk_tokens=64)
