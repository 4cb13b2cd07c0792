"""A checkpoint's named tensors as a model's layers take them: converted to one dtype and device, checked by shape."""

from __future__ import annotations

from collections.abc import Mapping

import torch

_TEXT_PREFIXES = ("model.", "model.language_model.", "language_model.model.")


class Weights:
    """Hugging Face named tensors, handed out converted to one dtype and device, checked by shape."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> None:
        self._tensors = tensors
        self.dtype = dtype
        self.device = device
        self.prefix = next(
            (p for p in _TEXT_PREFIXES if f"{p}embed_tokens.weight" in tensors),
            None,
        )
        if self.prefix is None:
            raise ValueError(
                "weights lack the token embedding: none of "
                + ", ".join(f"'{p}embed_tokens.weight'" for p in _TEXT_PREFIXES)
                + " is present"
            )

    def has(self, name: str) -> bool:
        return self._resolve(name) in self._tensors

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor ``name`` (``model.`` names are looked up under the checkpoint's prefix), of ``shape``."""
        full = self._resolve(name)
        tensor = self._tensors.get(full)
        if tensor is None:
            raise ValueError(f"weight '{full}' is missing from the checkpoint (expected shape {shape})")
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"weight '{full}' has shape {tuple(tensor.shape)}; the config implies {shape} "
                "(config.json does not match the weights)"
            )
        return tensor.to(device=self.device, dtype=self.dtype)

    def take_optional(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        return self.take(name, shape) if self.has(name) else None

    def _resolve(self, name: str) -> str:
        return f"{self.prefix}{name.removeprefix('model.')}" if name.startswith("model.") else name
