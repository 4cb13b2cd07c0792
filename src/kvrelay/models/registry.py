"""Which adapter serves which architecture: ``build_model(config, weights) -> PagedModel``."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from kvrelay.models.config import ModelConfig, UnsupportedModelError
from kvrelay.models.gemma3 import Gemma3Model
from kvrelay.models.layers import PagedModel
from kvrelay.models.llama import LlamaModel
from kvrelay.models.weights import Weights

__all__ = ["ADAPTERS", "PagedModel", "build_model"]

ADAPTERS: dict[str, Callable[[ModelConfig, Weights], PagedModel]] = {
    "gemma3": Gemma3Model,
    "llama": LlamaModel,
    "qwen2": LlamaModel,
    "qwen3": LlamaModel,
}


def build_model(
    config: ModelConfig,
    weights: Mapping[str, torch.Tensor],
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> PagedModel:
    """The paged model of ``config`` with Hugging Face named ``weights`` converted to ``dtype`` on ``device``.

    Raises ``UnsupportedModelError`` for an architecture without an adapter and
    ``ValueError`` naming the tensor when a weight is missing or mis-shaped.
    """
    adapter = ADAPTERS.get(config.architecture)
    if adapter is None:
        raise UnsupportedModelError(
            f"architecture '{config.architecture}' has no adapter; supported: {', '.join(ADAPTERS)}"
        )
    if config.num_heads % config.num_kv_heads:
        raise UnsupportedModelError(
            f"num_heads {config.num_heads} is not a multiple of num_kv_heads {config.num_kv_heads}"
        )
    return adapter(config, Weights(weights, dtype, torch.device(device)))
