"""Pytest fixtures over ``kvrelay.testing``: a moto S3 endpoint, test credentials, a fact-store database."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvrelay.testing.databases import ENABLE_PG, pg_base_url, postgres_schema_url, sqlite_file_url
from kvrelay.testing.moto import running_moto_server


def use_test_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """Point boto3 at dummy credentials so nothing reads a real AWS profile."""
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    """The endpoint URL of a moto_server that lives for the test module."""
    with running_moto_server() as url:
        yield url


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def fact_db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty fact-store database: a SQLite file, or a fresh PostgreSQL schema."""
    if request.param == "sqlite":
        yield sqlite_file_url(tmp_path)
        return
    base = pg_base_url()
    if base is None:
        pytest.skip(ENABLE_PG)
    with postgres_schema_url(base) as url:
        yield url
