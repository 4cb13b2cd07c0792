"""A module-scoped autouse fixture: import ``one_thread`` into a test module to run its torch work on one thread.

Tiny models and small tensors run fastest on one thread; two threads stall badly
when other processes share the cores.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
