"""Pytest fixtures over ``kvrelay.testing``: a moto S3 endpoint, test credentials, a fact-store database, real
vLLM servers of a tiny model shared by the session, the default model's (Gemma 3 270M's) tokenizer shared by
the session; and ``isa``, which runs a native kernel's test once per instruction set it is written for."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from kvrelay.models.kernels.native import build
from kvrelay.testing.databases import ENABLE_PG, pg_base_url, postgres_schema_url, sqlite_file_url
from kvrelay.testing.moto import running_moto_server

if TYPE_CHECKING:
    from kvrelay.launch.vllm_server import VllmServer


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


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama vLLM's CPU build serves (``kvrelay.testing.vllm``), written once per session."""
    from kvrelay.testing.vllm import make_vllm_tiny_model

    return make_vllm_tiny_model(tmp_path_factory.mktemp("vllm-model") / "tiny-llama")


@pytest.fixture(scope="session")
def vllm_engines(vllm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[VllmServer]]:
    """Two real vLLM servers of ``vllm_model`` (64 blocks of 64 tokens each) for the whole session.

    Start-up is the cost (about a minute on a quiet 2-core machine; they start together), so every vLLM test
    shares them; a test that kills or restarts one leaves it running again.
    """
    from kvrelay.testing.vllm import started_vllm_servers, tiny_vllm_spec

    specs = [tiny_vllm_spec(vllm_model), tiny_vllm_spec(vllm_model)]
    with started_vllm_servers(specs, tmp_path_factory.mktemp("vllm-logs")) as servers:
        yield servers


@pytest.fixture(scope="session")
def gemma_tokenizer() -> Any:
    """The tokenizer ``kvrelay serve`` serves its default model with."""
    from kvrelay.launch.catalog import load_served_model

    return load_served_model(None).tokenizer


@pytest.fixture(params=sorted(build.ISA_FLAGS))
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each instruction set the kernels are written for that this CPU has, made the one they take
    (``KVRELAY_NATIVE_ISA``); the others are skipped. An AVX-512 machine so tests the AVX2 ports too."""
    if not build.cpu_supports(request.param):
        pytest.skip(f"this CPU lacks {request.param}")
    monkeypatch.setenv(build.ISA_ENV, request.param)
    build.clear_caches()
    yield str(request.param)
    monkeypatch.undo()
    build.clear_caches()
