"""GGUF files to Hugging Face-named float32 tensors and a Hugging Face config dict.

``read_gguf(path)`` returns ``GgufModel(config, weights)``: ``config`` is the
``config.json`` dict ``transformers`` writes for the same architecture (so the
result also loads in ``transformers``), ``weights`` maps Hugging Face parameter
names to dequantized float32 tensors in Hugging Face layout. It raises
``ModelLoadError`` for an unreadable file, an unsupported architecture, rope
scaling, or tensors that do not match the metadata.

Conventions undone here, as llama.cpp's ``convert_hf_to_gguf.py`` applies them:
Gemma 3 stores every ``*norm.weight`` as ``1 + w`` (Hugging Face stores ``w``);
Llama permutes the rows of ``q_proj`` / ``k_proj`` for its interleaved rope
(Qwen2, Qwen3 and Gemma 3 use the NeoX layout and are stored unpermuted).
Gemma 3 metadata does not carry the local rope base, the layer pattern or the
attention scale: llama.cpp fixes them at 10,000, a global layer every 6th, and
``head_dim`` (``hidden / heads`` for the 62-layer 27B); the same values are used here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvrelay.models.config import ModelConfig, UnsupportedModelError
from kvrelay.models.loading.weight_layout import (
    ModelLoadError,
    check_weights,
    expected_tensor_shapes,
)

log = logging.getLogger(__name__)

GGUF_ARCHITECTURES = ("gemma3", "llama", "qwen2", "qwen3")
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10_000.0
GEMMA3_27B_LAYERS = 62
_CAUSAL_LM_CLASSES = {
    "gemma3": "Gemma3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


@dataclass(frozen=True, slots=True)
class GgufModel:
    """A GGUF file's model, in Hugging Face terms."""

    config: dict[str, Any]
    weights: dict[str, torch.Tensor]


def open_gguf(path: Path) -> Any:
    """A ``gguf.GGUFReader`` of ``path``; ``ModelLoadError`` when the file is missing or unreadable."""
    from gguf import GGUFReader

    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist; pass the path of a .gguf file")
    try:
        return GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError, TypeError) as exc:
        raise ModelLoadError(
            f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc}); "
            "it may be truncated or corrupt: download or assemble it again"
        ) from exc


def gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    """The value of metadata ``key`` (a scalar, string or list), or ``default`` when absent."""
    field = reader.get_field(key)
    return default if field is None else field.contents()


def gguf_architecture(reader: Any, path: Path) -> str:
    """``general.architecture``, checked against ``GGUF_ARCHITECTURES``."""
    arch = gguf_field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: GGUF architecture '{arch}' is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}. "
            "Use a model of a supported architecture"
        )
    return str(arch)


def _tensor_shapes(reader: Any) -> dict[str, tuple[int, ...]]:
    """GGUF tensor names mapped to their shapes in row-major (Hugging Face) order."""
    return {t.name: tuple(int(n) for n in reversed(t.shape.tolist())) for t in reader.tensors}


def gguf_config(reader: Any, path: Path) -> dict[str, Any]:
    """The Hugging Face ``config.json`` dict of the model in ``reader``."""
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

    arch = gguf_architecture(reader, path)
    shapes = _tensor_shapes(reader)

    def meta(key: str, default: Any = None) -> Any:
        value = gguf_field(reader, f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks '{arch}.{key}'; the file is incomplete")
        return value

    if gguf_field(reader, f"{arch}.rope.scaling.type", "none") != "none" or "rope_freqs.weight" in shapes:
        raise ModelLoadError(f"{path}: rope scaling is not supported; use a model without rope scaling")
    if "token_embd.weight" not in shapes:
        raise ModelLoadError(f"{path}: GGUF file has no token_embd.weight tensor; the file is incomplete")
    hidden = int(meta("embedding_length"))
    heads = int(meta("attention.head_count"))
    layers = int(meta("block_count"))
    head_dim = int(
        gguf_field(reader, f"{arch}.attention.key_length", 0)
        or gguf_field(reader, f"{arch}.rope.dimension_count", 0)
        or hidden // heads
    )
    eos = gguf_field(reader, "tokenizer.ggml.eos_token_id")
    tokens = gguf_field(reader, "tokenizer.ggml.tokens") or []
    if not tokens:
        raise ModelLoadError(
            f"{path}: GGUF metadata has no tokenizer (tokenizer.ggml.tokens); "
            "use a GGUF file written with its tokenizer"
        )
    eos_ids = [int(eos)] if eos is not None else []
    if arch == "gemma3" and "<end_of_turn>" in tokens:
        eos_ids.append(tokens.index("<end_of_turn>"))
    common: dict[str, Any] = {
        "vocab_size": shapes["token_embd.weight"][0],
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(gguf_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(meta("context_length")),
        "tie_word_embeddings": "output.weight" not in shapes,
        "bos_token_id": gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None),
        "pad_token_id": gguf_field(reader, "tokenizer.ggml.padding_token_id"),
    }
    theta = float(gguf_field(reader, f"{arch}.rope.freq_base", 10_000.0))
    if arch == "gemma3":
        window = int(meta("attention.sliding_window"))
        config = Gemma3TextConfig(
            **common,
            sliding_window=window,
            query_pre_attn_scalar=hidden // heads if layers == GEMMA3_27B_LAYERS else head_dim,
            layer_types=[
                "full_attention" if (i + 1) % GEMMA3_SLIDING_PATTERN == 0 else "sliding_attention"
                for i in range(layers)
            ],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_ROPE_BASE},
                "full_attention": {"rope_type": "default", "rope_theta": theta},
            },
        )
    else:
        classes = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
        extra: dict[str, Any] = {}
        if arch == "llama":
            extra["attention_bias"] = "blk.0.attn_q.bias" in shapes
        config = classes[arch](**common, **extra, rope_parameters={"rope_type": "default", "rope_theta": theta})
    return {**config.to_dict(), "architectures": [_CAUSAL_LM_CLASSES[arch]]}


def _gguf_name_map(arch: str, num_layers: int, hf_names: list[str]) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face name for ``hf_names``, from gguf-py's own name table."""
    import gguf

    arch_enum = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    table = gguf.get_tensor_name_map(arch_enum, num_layers)
    mapping: dict[str, str] = {}
    for hf_name in hf_names:
        base, suffix = hf_name.rsplit(".", 1)
        gguf_base = table.get_name(base)
        if gguf_base is not None:
            mapping[f"{gguf_base}.{suffix}"] = hf_name
    return mapping


def unpermute_rope_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute`` of q/k rows (interleaved rope pairs back to rotate-half halves)."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _dequantize(tensor: Any) -> torch.Tensor:
    from gguf.quants import dequantize

    array = dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    return torch.from_numpy(np.require(array, np.float32, ["C_CONTIGUOUS", "WRITEABLE"])).reshape(shape)


def gguf_weights(reader: Any, config: ModelConfig, path: Path) -> dict[str, torch.Tensor]:
    """All tensors of ``reader`` under Hugging Face names, dequantized to float32, conventions undone, checked."""
    expected = expected_tensor_shapes(config)
    to_hf = _gguf_name_map(config.architecture, config.num_layers, list(expected))
    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = to_hf.get(tensor.name, tensor.name)
        try:
            value = _dequantize(tensor)
        except (ValueError, NotImplementedError, TypeError) as exc:
            raise ModelLoadError(
                f"{path}: tensor {tensor.name} ({tensor.tensor_type.name}) cannot be dequantized: {exc}; "
                "use a GGUF file with a quantization gguf-py supports"
            ) from exc
        if config.architecture == "gemma3" and name.endswith("norm.weight"):
            value = value - 1.0
        elif config.architecture == "llama" and name.endswith("q_proj.weight"):
            value = unpermute_rope_rows(value, config.num_heads)
        elif config.architecture == "llama" and name.endswith("k_proj.weight"):
            value = unpermute_rope_rows(value, config.num_kv_heads)
        weights[name] = value
    return check_weights(weights, config, str(path))


def read_gguf(path: Path) -> GgufModel:
    """Read and dequantize the GGUF file at ``path`` (see the module docstring for the contract)."""
    reader = open_gguf(path)
    config_dict = gguf_config(reader, path)
    try:
        config = ModelConfig.from_hf(config_dict)
    except UnsupportedModelError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    log.info("dequantizing %d tensors of %s", len(reader.tensors), path)
    return GgufModel(config=config_dict, weights=gguf_weights(reader, config, path))
