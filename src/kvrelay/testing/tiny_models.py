"""Tiny random models of real architectures, saved as real Hugging Face artifacts.

``make_tiny_model(arch, directory, seed)`` builds a randomly initialised
``transformers`` model of ``arch`` (``gemma3``, ``llama``, ``qwen2``,
``qwen3``), writes ``config.json`` + ``model.safetensors`` and a tiny
byte-level BPE tokenizer (``tokenizer.json``, ``tokenizer_config.json``, a chat
template) into ``directory`` and returns ``directory``. The same arguments
always write the same bytes. Every parameter is random, norm weights and
biases included, so a loader or adapter that drops, transposes or offsets a
tensor changes the logits.

Token ids shared by the config and the tokenizer: ``PAD_ID`` 0, ``EOS_ID`` 1,
``BOS_ID`` 2, ``UNK_ID`` 3. ``tokenizer vocabulary == config vocab_size``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
TINY_ARCHITECTURES = ("gemma3", "llama", "qwen2", "qwen3")

TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<start_of_turn>{{ message['role'] }}\n{{ message['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>assistant\n{% endif %}"
)

_CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "A paged key value cache keeps attention state in fixed size pages.",
    "Routers send each request to the worker where it starts fastest.",
    "the quick brown fox jumps over the lazy dog 0123456789",
    "Hello, world! How are you today? I am fine, thank you.",
]

_COMMON: dict[str, Any] = {
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "pad_token_id": PAD_ID,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
}

TINY_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3": dict(
        _COMMON,
        num_hidden_layers=6,
        head_dim=32,
        sliding_window=16,
        query_pre_attn_scalar=24,
        tie_word_embeddings=True,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        },
    ),
    "llama": dict(
        _COMMON,
        num_hidden_layers=2,
        head_dim=16,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
    ),
    "qwen2": dict(
        _COMMON,
        num_hidden_layers=2,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    ),
    "qwen3": dict(
        _COMMON,
        num_hidden_layers=2,
        head_dim=32,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    ),
}

_CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {
    "gemma3": Gemma3TextConfig,
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
}


def tiny_config(arch: str, **overrides: Any) -> PretrainedConfig:
    """The ``transformers`` config of a tiny ``arch`` model: ``TINY_DEFAULTS[arch]`` updated by ``overrides``."""
    if arch not in _CONFIG_CLASSES:
        raise ValueError(f"no tiny model for architecture '{arch}'; choose one of {', '.join(TINY_ARCHITECTURES)}")
    return _CONFIG_CLASSES[arch](**{**TINY_DEFAULTS[arch], **overrides})


def build_tiny_model(arch: str, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """A float32 ``transformers`` causal LM of ``arch`` with every parameter drawn from ``seed``."""
    config = tiny_config(arch, **overrides)
    generator = torch.Generator().manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if "norm" in name:
                base = 0.0 if arch == "gemma3" else 1.0
                param.copy_(base + 0.1 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.05 * noise)
            else:
                param.copy_(0.08 * noise)
    return model.eval()


def build_tiny_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with exactly ``vocab_size`` tokens (specials first, then bytes, merges, fillers)."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS, trainer=trainer)
    fillers = [f"<unused{i}>" for i in range(vocab_size - tokenizer.get_vocab_size())]
    tokenizer.add_special_tokens(fillers)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is below the {tokenizer.get_vocab_size()} base tokens")
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        chat_template=TINY_CHAT_TEMPLATE,
    )


def make_tiny_model(arch: str, directory: Path, seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny random ``arch`` model (safetensors + config.json + tokenizer) into ``directory``; return it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(arch, seed=seed, **overrides)
    model.save_pretrained(directory)
    build_tiny_tokenizer(model.config.vocab_size).save_pretrained(directory)
    return directory
