"""The contract between a ``ModelConfig`` and its weight tensors.

``expected_tensor_shapes(config)`` lists every Hugging Face parameter name an
adapter reads, with its shape. ``check_weights(weights, config, source)``
returns the weights restricted to those names, or raises ``ModelLoadError``
naming the source, every missing or misshapen tensor, and the fix. Names follow
Hugging Face ``*ForCausalLM`` checkpoints (``model.layers.{i}.self_attn.q_proj.weight``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvrelay.models.config import ModelConfig

_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
_MAX_LISTED = 8


class ModelLoadError(RuntimeError):
    """A model source that cannot be loaded; the message names the file and the fix."""


def expected_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter name of ``config``'s architecture mapped to its shape (``lm_head`` only when untied)."""
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q_out, kv_out = config.num_heads * d, config.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    norms = ["input_layernorm", "post_attention_layernorm"]
    if config.architecture == "gemma3":
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (q_out, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_out)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_out,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_out,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_out,)
            if config.architecture != "qwen2":
                shapes[p + "self_attn.o_proj.bias"] = (h,)
        if config.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
        for norm in norms:
            shapes[p + norm + ".weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def _listing(items: list[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED])
    return shown + (f" (and {len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else "")


def check_weights(weights: Mapping[str, torch.Tensor], config: ModelConfig, source: str) -> dict[str, torch.Tensor]:
    """``weights`` restricted to ``expected_tensor_shapes(config)``; raises ``ModelLoadError`` on any mismatch.

    Tolerated extras: rotary ``inv_freq`` buffers and, for a tied model, a stored
    ``lm_head.weight`` (the embedding is used). Any other extra tensor is an error,
    because dropping it would silently change the model.
    """
    expected = expected_tensor_shapes(config)
    missing = [name for name in expected if name not in weights]
    wrong = [
        f"{name} {tuple(weights[name].shape)} (config implies {shape})"
        for name, shape in expected.items()
        if name in weights and tuple(weights[name].shape) != shape
    ]
    tolerated = {"lm_head.weight"} if config.tie_word_embeddings else set()
    extra = [
        name
        for name in weights
        if name not in expected and name not in tolerated and not name.endswith(_IGNORED_SUFFIXES)
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors: {_listing(missing)}")
    if wrong:
        problems.append(f"wrong shapes: {_listing(wrong)}")
    if extra:
        problems.append(f"tensors the {config.architecture} config does not use: {_listing(extra)}")
    if problems:
        raise ModelLoadError(
            f"{source}: the weights do not match its config ({config.architecture}, {config.num_layers} layers, "
            f"hidden {config.hidden_size}, vocab {config.vocab_size}): {'; '.join(problems)}. "
            "Use the config.json that was saved with these weights, or re-export the checkpoint."
        )
    return {name: weights[name] for name in expected}
