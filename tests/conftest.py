"""Test-wide settings: user data (fact store, chunk directories) goes to a temporary directory, and the
shared fixtures of ``tests/support/fixtures.py`` (moto S3, fact-store databases) are available to every test.

The cache directory (assembled GGUF, dequantized weights, converted tokenizers)
is left at its default so the real model is built once per machine.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

pytest_plugins = ["tests.support.fixtures"]


@pytest.fixture(autouse=True, scope="session")
def private_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    previous = os.environ.get("KVRELAY_DATA_DIR")
    os.environ["KVRELAY_DATA_DIR"] = str(tmp_path_factory.mktemp("kvrelay-data"))
    yield
    if previous is None:
        os.environ.pop("KVRELAY_DATA_DIR", None)
    else:
        os.environ["KVRELAY_DATA_DIR"] = previous
