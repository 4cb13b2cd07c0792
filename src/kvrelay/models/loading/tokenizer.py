"""Tokenizers: from a Hugging Face directory, or converted once from GGUF metadata.

``load_tokenizer(directory)`` returns a ``PreTrainedTokenizerFast`` from
``tokenizer.json`` (+ ``tokenizer_config.json``, chat template) in
``directory``. ``convert_gguf_tokenizer(gguf_path, out_dir)`` converts the
tokenizer stored in a GGUF file's metadata with ``transformers`` and saves it
into ``out_dir`` so later loads read ``tokenizer.json`` directly. A Gemma 3
GGUF without a chat template gets ``GEMMA_CHAT_TEMPLATE`` (Gemma's turn
format: ``<start_of_turn>user`` / ``<start_of_turn>model``, a system message
prefixed to the first user turn).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from kvrelay.models.loading.weight_layout import ModelLoadError

_LOADER_ONLY_KEYS = frozenset(
    {
        "tokenizer_class",
        "backend",
        "is_local",
        "local_files_only",
        "auto_map",
        "name_or_path",
        "tokenizer_file",
        "added_tokens_decoder",
    }
)

GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set prefix = messages[0]['content'] + '\\n\\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{{ (prefix if loop.first else '') + message['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def load_tokenizer(directory: Path) -> PreTrainedTokenizerFast:
    """The tokenizer saved in ``directory``; ``ModelLoadError`` when it has none or it is unreadable.

    Built straight from ``tokenizer.json`` with the options of ``tokenizer_config.json``
    and the chat template: ``from_pretrained`` would also parse the (for Gemma 33 MB)
    ``tokenizer.json`` in Python, several seconds on a busy machine.
    """
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise ModelLoadError(
            f"{directory} has no tokenizer.json; save the model's tokenizer there "
            "(tokenizer.save_pretrained(directory))"
        )
    try:
        options = _tokenizer_options(directory)
        return PreTrainedTokenizerFast(tokenizer_file=str(path), name_or_path=str(directory), **options)
    except Exception as exc:  # the tokenizers library raises plain Exception on a malformed file
        raise ModelLoadError(f"{path} cannot be read ({exc}); save the tokenizer again") from exc


def _tokenizer_options(directory: Path) -> dict[str, Any]:
    """Constructor options from ``tokenizer_config.json`` and ``chat_template.jinja`` / ``.json``."""
    config_path = directory / "tokenizer_config.json"
    raw = json.loads(config_path.read_text()) if config_path.is_file() else {}
    options = {key: value for key, value in raw.items() if key not in _LOADER_ONLY_KEYS}
    for key, value in list(options.items()):
        if isinstance(value, dict) and "content" in value:
            options[key] = value["content"]
    template_path = directory / "chat_template.jinja"
    legacy_path = directory / "chat_template.json"
    if template_path.is_file():
        options["chat_template"] = template_path.read_text()
    elif legacy_path.is_file():
        options["chat_template"] = json.loads(legacy_path.read_text())["chat_template"]
    return options


def convert_gguf_tokenizer(gguf_path: Path, out_dir: Path, architecture: str) -> None:
    """Convert the tokenizer in ``gguf_path``'s metadata; save it (``tokenizer.json``, config) into ``out_dir``."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True)
    except Exception as exc:  # transformers' converters raise many kinds on metadata they cannot use
        raise ModelLoadError(
            f"{gguf_path}: its tokenizer metadata cannot be converted ({type(exc).__name__}: {exc}); "
            "use a GGUF file written with tokenizer metadata (tokenizer.ggml.*)"
        ) from exc
    if architecture == "gemma3" and not tokenizer.chat_template and "<start_of_turn>" in tokenizer.get_vocab():
        tokenizer.chat_template = GEMMA_CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)
