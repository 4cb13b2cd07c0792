"""The cluster across network namespaces that every test here shares, or a skip that says what is missing."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvrelay.testing.lab_services import postgres_missing
from kvrelay.testing.netns import unavailable_reason
from kvrelay.testing.netns_cluster import LabCluster


@pytest.fixture(scope="session")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabCluster]:
    reason = unavailable_reason() or postgres_missing()
    if reason is not None:
        pytest.skip(f"no cluster across network namespaces here: {reason}")
    cluster = LabCluster(tmp_path_factory.mktemp("lab")).start()
    try:
        yield cluster
    finally:
        cluster.close()
