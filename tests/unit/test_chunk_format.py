"""The chunk stored form: round trips without copies, and every corruption is caught."""

from __future__ import annotations

import mmap

import pytest
import torch

from kvrelay.protocol.chunk_keys import chunk_chain
from kvrelay.store.chunk_format import (
    PAYLOAD_ALIGN,
    ChunkCorrupt,
    decode_chunk,
    decode_header,
    encode_chunk,
    encode_chunk_bytes,
)

FP = b"gemma3-270m|bf16|paged-v1|64"
KEY = chunk_chain(FP, list(range(64)), 64)[0]
SHAPE = (3, 2, 4, 1, 8)


def _kv(dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_keeps_shape_dtype_and_values(dtype: torch.dtype) -> None:
    kv = _kv(dtype)
    blob = encode_chunk(KEY, FP, kv)
    view = decode_chunk(blob, KEY, FP)
    assert view.header.shape == SHAPE
    assert view.header.dtype == str(dtype).removeprefix("torch.")
    assert view.header.fingerprint == FP
    assert view.header.header_len % PAYLOAD_ALIGN == 0
    assert torch.equal(view.tensor(), kv)


def test_tensor_is_a_view_of_the_stored_bytes_not_a_copy() -> None:
    blob = encode_chunk(KEY, FP, _kv())
    view = decode_chunk(blob, KEY, FP)
    tensor = view.tensor()
    base = memoryview(blob)
    assert tensor.data_ptr() == torch.frombuffer(blob, dtype=torch.uint8).data_ptr() + view.header.header_len
    assert base.nbytes == view.header.total_len


def test_noncontiguous_tensor_is_stored_in_logical_order() -> None:
    kv = _kv().transpose(2, 4)
    view = decode_chunk(encode_chunk(KEY, FP, kv), KEY, FP)
    assert torch.equal(view.tensor(), kv)


def test_raw_bytes_encoding_matches_tensor_encoding() -> None:
    kv = _kv(torch.bfloat16)
    raw = kv.contiguous().view(torch.uint8).numpy().tobytes()
    assert encode_chunk_bytes(KEY, FP, SHAPE, "bfloat16", raw) == encode_chunk(KEY, FP, kv)


def test_decodes_in_place_from_an_mmap(tmp_path) -> None:
    kv = _kv()
    path = tmp_path / "c.kvc"
    path.write_bytes(encode_chunk(KEY, FP, kv))
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    assert torch.equal(decode_chunk(mapped, KEY, FP).tensor(), kv)


def test_every_flipped_header_byte_is_detected() -> None:
    blob = encode_chunk(KEY, FP, _kv())
    header_len = decode_header(blob).header_len
    for i in range(header_len):
        bad = bytearray(blob)
        bad[i] ^= 0x01
        with pytest.raises(ChunkCorrupt):
            decode_chunk(bad, KEY, FP)


@pytest.mark.parametrize("where", [0, 1, -1])
def test_flipped_payload_byte_is_detected(where: int) -> None:
    blob = encode_chunk(KEY, FP, _kv())
    header_len = decode_header(blob).header_len
    bad = bytearray(blob)
    index = {0: header_len, 1: (header_len + len(blob)) // 2, -1: len(blob) - 1}[where]
    bad[index] ^= 0x80
    with pytest.raises(ChunkCorrupt, match="payload digest"):
        decode_chunk(bad, KEY, FP)
    assert torch.is_tensor(decode_chunk(bad, KEY, FP, verify_payload=False).tensor())


def test_wrong_key_or_fingerprint_or_length_is_corrupt() -> None:
    blob = encode_chunk(KEY, FP, _kv())
    with pytest.raises(ChunkCorrupt, match="key mismatch"):
        decode_chunk(blob, bytes(16), FP)
    with pytest.raises(ChunkCorrupt, match="fingerprint"):
        decode_chunk(blob, KEY, b"another model")
    with pytest.raises(ChunkCorrupt, match="length"):
        decode_chunk(blob[:-1], KEY, FP)
    with pytest.raises(ChunkCorrupt, match="length"):
        decode_chunk(blob + b"\0", KEY, FP)
    with pytest.raises(ChunkCorrupt, match="truncated"):
        decode_chunk(blob[:10], KEY, FP)
    with pytest.raises(ChunkCorrupt):
        decode_chunk(b"", KEY, FP)


def test_fingerprint_is_optional_for_the_reader() -> None:
    blob = encode_chunk(KEY, FP, _kv())
    assert decode_chunk(blob, KEY).header.fingerprint == FP


def test_bad_inputs_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="storable dtypes"):
        encode_chunk(KEY, FP, torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(ValueError, match="16 bytes"):
        encode_chunk(b"short", FP, _kv())
    with pytest.raises(ValueError, match="needs"):
        encode_chunk_bytes(KEY, FP, SHAPE, "float32", b"\0" * 7)


def test_empty_payload_round_trips() -> None:
    view = decode_chunk(encode_chunk(KEY, FP, torch.zeros(0, 4)), KEY, FP)
    assert view.tensor().shape == (0, 4)


def test_copy_into_pages_checks_shape_and_dtype() -> None:
    kv = _kv(torch.bfloat16)
    view = decode_chunk(encode_chunk(KEY, FP, kv), KEY, FP)
    pages = torch.zeros((2, *SHAPE), dtype=torch.bfloat16)
    view.copy_into(pages[1])
    assert torch.equal(pages[1], kv) and not pages[0].any()
    with pytest.raises(ValueError, match="destination"):
        view.copy_into(torch.zeros(SHAPE, dtype=torch.float32))
