"""The S3 object tier against a real moto_server on loopback, through boto3."""

from __future__ import annotations

import mmap
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvrelay.protocol.chunk_keys import chunk_chain
from kvrelay.store.chunk_format import decode_header, encode_chunk
from kvrelay.store.files import SsdTier
from kvrelay.store.s3 import S3Tier
from kvrelay.store.tier import CorruptChunk, ResidencyEvent
from kvrelay.store.tier_stack import TierStack
from tests.support.fixtures import use_test_credentials

FP = b"tiny-gemma3|float32|64"
SHAPE = (2, 2, 8, 1, 8)
KEYS = chunk_chain(FP, list(range(64 * 6)), 64)


def chunk(i: int) -> bytearray:
    return encode_chunk(KEYS[i], FP, torch.full(SHAPE, float(i)))


@pytest.fixture()
def s3(
    moto_endpoint: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> Iterator[tuple[S3Tier, list]]:  # noqa: F811
    use_test_credentials(monkeypatch)
    reports: list = []
    bucket = "kvrelay-" + request.node.name.lower().replace("_", "-")[:40]
    tier = S3Tier(S3Tier.make_client(moto_endpoint), bucket, "chunks/", reports.append, reports.append)
    tier.create_bucket()
    yield tier, reports


def test_put_get_contains_remove_and_counters(s3: tuple[S3Tier, list]) -> None:
    tier, reports = s3
    assert tier.get(KEYS[0], FP) is None and not tier.contains(KEYS[0])
    assert tier.put(chunk(0)) is True
    assert tier.contains(KEYS[0]) and tier.keys() == [KEYS[0]]
    view = tier.get(KEYS[0], FP)
    assert view is not None and torch.equal(view.tensor(), torch.zeros(SHAPE))
    assert tier.remove(KEYS[0]) is True and tier.remove(KEYS[0]) is False
    assert tier.get(KEYS[0], FP) is None
    c = tier.counters()
    size = len(chunk(0))
    assert (c.hits, c.misses, c.bytes_read, c.bytes_written, c.removals) == (1, 2, size, size, 1)
    assert reports == [
        ResidencyEvent("object", True, (KEYS[0],), (), "stored"),
        ResidencyEvent("object", True, (), (KEYS[0],), "removed"),
    ]


def test_conditional_put_never_overwrites_an_existing_object(s3: tuple[S3Tier, list]) -> None:
    tier, reports = s3
    assert tier.put(chunk(1)) is True
    assert tier.put(chunk(1)) is False
    raw = tier._client.get_object(Bucket=tier.bucket, Key=tier.object_name(KEYS[1]))["Body"].read()
    assert raw == bytes(chunk(1))
    assert tier.counters().chunks_written == 1
    assert [e.reason for e in reports] == ["stored"]


def test_prefix_and_bucket_are_configurable(s3: tuple[S3Tier, list]) -> None:
    tier, _ = s3
    tier.put(chunk(2))
    names = [o["Key"] for o in tier._client.list_objects_v2(Bucket=tier.bucket)["Contents"]]
    assert names == [f"chunks/{KEYS[2].hex()}.kvc"]
    other = S3Tier(tier._client, tier.bucket, "elsewhere/")
    assert other.keys() == [] and other.get(KEYS[2], FP) is None
    with pytest.raises(ValueError, match="3 to 63"):
        S3Tier(tier._client, "ab")


@pytest.mark.parametrize("part", ["payload", "header"])
def test_corrupt_object_is_detected_counted_removed_and_missed(s3: tuple[S3Tier, list], part: str) -> None:
    tier, reports = s3
    bad = chunk(3)
    bad[decode_header(bad).header_len + 5 if part == "payload" else 20] ^= 0x01
    tier._client.put_object(Bucket=tier.bucket, Key=tier.object_name(KEYS[3]), Body=bytes(bad))
    assert tier.get(KEYS[3], FP) is None
    assert not tier.contains(KEYS[3])
    assert tier.counters().corrupt == 1
    corrupt = [r for r in reports if isinstance(r, CorruptChunk)]
    assert [(c.tier, c.key) for c in corrupt] == [("object", KEYS[3])]
    assert [r.reason for r in reports if isinstance(r, ResidencyEvent)] == ["corrupt"]


def test_object_chunk_is_localized_into_ssd_and_read_through_mmap(s3: tuple[S3Tier, list], tmp_path: Path) -> None:
    tier, _ = s3
    tier.put(chunk(4))
    stack = TierStack(None, SsdTier(tmp_path / "ssd", 1 << 20, fsync=False), tier)
    hit = stack.get(KEYS[4], FP)
    assert hit is not None and hit.tier == "object"
    assert isinstance(hit.view.buffer, mmap.mmap)
    assert torch.equal(hit.view.tensor(), torch.full(SHAPE, 4.0))
    assert (tmp_path / "ssd" / f"{KEYS[4].hex()}.kvc").read_bytes() == bytes(chunk(4))
    assert stack.residency(KEYS[4]) == ("ssd", "object")


def test_unreachable_endpoint_is_a_counted_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    use_test_credentials(monkeypatch)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = S3Tier.make_client(f"http://127.0.0.1:{port}", connect_timeout_s=1.0, read_timeout_s=1.0)
    tier = S3Tier(client, "kvrelay-nowhere")
    assert tier.get(KEYS[0], FP) is None
    assert tier.counters().errors == 1 and tier.counters().misses == 1
