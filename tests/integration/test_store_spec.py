"""A worker's object tier from its configuration: S3 (moto over HTTP) or a shared directory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvrelay.launch.worker_assembly import StoreSpec
from kvrelay.store.chunk_format import encode_chunk
from kvrelay.store.files import SharedDirTier
from kvrelay.store.s3 import S3Tier
from kvrelay.store.tier import ResidencyEvent
from tests.support.fixtures import use_test_credentials

KEY, FP = b"k" * 16, b"fp"


def test_s3_object_tier_from_the_store_spec(
    moto_endpoint: str,
    monkeypatch: pytest.MonkeyPatch,  # noqa: F811
    tmp_path: Path,
) -> None:
    use_test_credentials(monkeypatch)
    events: list[ResidencyEvent] = []
    spec = StoreSpec(str(tmp_path / "ssd"), s3_endpoint=moto_endpoint, s3_bucket="kvrelay-spec", s3_prefix="w/")
    tier = spec.object_tier(events.append)
    assert isinstance(tier, S3Tier)
    tier.create_bucket()
    assert tier.put(encode_chunk(KEY, FP, torch.ones(2, 2, 4, 1, 4)))
    view = tier.get(KEY, FP)
    assert view is not None and torch.equal(view.tensor(), torch.ones(2, 2, 4, 1, 4))
    assert events and events[-1].stored == (KEY,) and events[-1].durable


def test_shared_directory_or_no_object_tier(tmp_path: Path) -> None:
    assert isinstance(
        StoreSpec(str(tmp_path / "ssd"), object_dir=str(tmp_path / "obj")).object_tier(print), SharedDirTier
    )
    assert StoreSpec(str(tmp_path / "ssd")).object_tier(print) is None
