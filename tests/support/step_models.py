"""Step models for runtime tests: a real model's ``logits`` and ``greedy`` behind test-controlled ``hidden``."""

from __future__ import annotations

from typing import Any

import torch

from kvrelay.models.batch import ForwardBatch
from kvrelay.models.kernels.kv_pages import KVPages


class DelegatingModel:
    """The real model's ``logits`` and ``greedy``."""

    model: Any

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.logits(h)

    def greedy(self, h: torch.Tensor) -> list[int]:
        return self.model.greedy(h)


class RecordingModel(DelegatingModel):
    """The real model, recording the query lengths of every forward."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.batches: list[list[int]] = []

    def hidden(self, batch: ForwardBatch, kv: KVPages) -> torch.Tensor:
        self.batches.append(list(batch.query_lens))
        return self.model.hidden(batch, kv)
