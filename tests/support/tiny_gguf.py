"""Write a tiny Hugging Face model directory as a GGUF file, the way llama.cpp does.

``write_tiny_gguf(model_dir, path, quantize=False)`` reads ``config.json`` and
``model.safetensors`` written by ``tiny_models.make_tiny_model`` and writes
``path`` with ``gguf.GGUFWriter``, applying llama.cpp's ``convert_hf_to_gguf.py``
conventions: Gemma 3 norm weights stored as ``1 + w``; Llama ``q_proj`` /
``k_proj`` rows permuted for interleaved rope; tensor names from gguf-py's
name table; a SentencePiece-style (``llama``) tokenizer in the metadata.
With ``quantize=True`` the 2-D projection matrices are stored as Q8_0 (the
embedding and norms stay F32); Hugging Face names in ``drop`` are left out,
and so is the tokenizer when ``with_tokenizer`` is False.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

from kvrelay.testing.tiny_models import SPECIAL_TOKENS

_WORDS = ["the", "capital", "of", "France", "is", "Paris", "hello", "world", "page", "cache"]
_ARCH_ENUMS = {
    "gemma3": gguf.MODEL_ARCH.GEMMA3,
    "llama": gguf.MODEL_ARCH.LLAMA,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
}


def llama_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: rotate-half rows to interleaved rope pairs."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _tokenizer_metadata(writer: gguf.GGUFWriter, vocab_size: int, chat_template: str | None) -> None:
    pieces = ["\u2581"] + [f"\u2581{w}" for w in _WORDS] + list("abcdefghijklmnopqrstuvwxyzFP")
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokens = SPECIAL_TOKENS + byte_tokens + pieces
    tokens += [f"<unused{i}>" for i in range(vocab_size - len(tokens))]
    types = (
        [gguf.TokenType.CONTROL] * 3
        + [gguf.TokenType.UNKNOWN]
        + [gguf.TokenType.CONTROL] * 2
        + [gguf.TokenType.BYTE] * 256
        + [gguf.TokenType.NORMAL] * len(pieces)
        + [gguf.TokenType.USER_DEFINED] * (vocab_size - len(SPECIAL_TOKENS) - 256 - len(pieces))
    )
    scores = [0.0] * (len(SPECIAL_TOKENS) + 256) + [-float(i) for i in range(len(pieces))]
    scores += [0.0] * (vocab_size - len(scores))
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    if chat_template is not None:
        writer.add_chat_template(chat_template)


def write_tiny_gguf(
    model_dir: Path,
    path: Path,
    quantize: bool = False,
    chat_template: str | None = None,
    drop: Collection[str] = (),
    with_tokenizer: bool = True,
) -> Path:
    """Write the tiny model in ``model_dir`` (any of ``TINY_ARCHITECTURES``) to the GGUF file ``path``; return it."""
    config = json.loads((model_dir / "config.json").read_text())
    arch = "gemma3" if config["model_type"] == "gemma3_text" else config["model_type"]
    layers, heads, kv_heads = config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if arch == "gemma3":
        writer.add_rope_freq_base(config["rope_parameters"]["full_attention"]["rope_theta"])
        writer.add_sliding_window(config["sliding_window"])
    else:
        writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    if with_tokenizer:
        _tokenizer_metadata(writer, config["vocab_size"], chat_template)

    names = gguf.get_tensor_name_map(_ARCH_ENUMS[arch], layers)
    for hf_name, value in sorted(load_file(model_dir / "model.safetensors").items()):
        if hf_name in drop:
            continue
        base, suffix = hf_name.rsplit(".", 1)
        data = value.astype(np.float32)
        if arch == "gemma3" and hf_name.endswith("norm.weight"):
            data = data + 1.0
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            data = llama_permute(data, heads)
        if arch == "llama" and hf_name.endswith("k_proj.weight"):
            data = llama_permute(data, kv_heads)
        gguf_name = f"{names.get_name(base)}.{suffix}"
        if quantize and data.ndim == 2 and "embed_tokens" not in hf_name:
            packed = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(gguf_name, packed, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
