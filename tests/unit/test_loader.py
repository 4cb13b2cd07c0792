"""Loading tiny random Hugging Face model directories: weights, config, tokenizer, fingerprint, errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvrelay.models.config import ModelConfig
from kvrelay.models.loading.fingerprint import (
    DEFAULT_PAGE_LAYOUT,
    model_fingerprint,
)
from kvrelay.models.loading.loader import LoadedArtifacts, load_artifacts
from kvrelay.models.loading.weight_layout import ModelLoadError, expected_tensor_shapes
from kvrelay.protocol.chunk_keys import DEFAULT_CHUNK_TOKENS
from kvrelay.testing.tiny_models import TINY_ARCHITECTURES, make_tiny_model

PROMPT = "The capital of France is Paris."


@pytest.fixture(scope="module", params=TINY_ARCHITECTURES)
def tiny_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(request.param, tmp_path_factory.mktemp(request.param), seed=11)


@pytest.fixture()
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_directory_weights_equal_what_transformers_saved(tiny_dir: Path, cache: Path) -> None:
    artifacts = load_artifacts(tiny_dir, cache_dir=cache)
    reference = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).state_dict()
    assert isinstance(artifacts, LoadedArtifacts)
    assert set(artifacts.weights) == set(expected_tensor_shapes(artifacts.config))
    for name, tensor in artifacts.weights.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, reference[name]), name
    assert ("lm_head.weight" in artifacts.weights) == (not artifacts.config.tie_word_embeddings)
    assert artifacts.model_dir == tiny_dir
    assert artifacts.name == tiny_dir.name


def test_directory_config_matches_config_json(tiny_dir: Path, cache: Path) -> None:
    artifacts = load_artifacts(tiny_dir, cache_dir=cache)
    raw = json.loads((tiny_dir / "config.json").read_text())
    assert artifacts.config == ModelConfig.from_hf(raw)
    assert artifacts.config.num_layers == raw["num_hidden_layers"]
    assert artifacts.config.vocab_size == len(artifacts.tokenizer)


def test_directory_tokenizer_matches_transformers(tiny_dir: Path, cache: Path) -> None:
    artifacts = load_artifacts(tiny_dir, cache_dir=cache)
    reference = AutoTokenizer.from_pretrained(tiny_dir)
    text = f"<start_of_turn>user\n{PROMPT}  \tünïcödé<end_of_turn>"
    assert artifacts.tokenizer(text).input_ids == reference(text).input_ids
    assert artifacts.tokenizer.all_special_tokens == reference.all_special_tokens
    assert (artifacts.tokenizer.bos_token_id, artifacts.tokenizer.eos_token_id, artifacts.tokenizer.pad_token_id) == (
        2,
        1,
        0,
    )
    assert artifacts.tokenizer.chat_template == reference.chat_template
    assert artifacts.tokenizer.decode(artifacts.tokenizer(PROMPT).input_ids) == PROMPT
    chat = artifacts.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("<start_of_turn>assistant\n")


def test_bfloat16_weights_are_the_rounded_float32_weights(tiny_dir: Path, cache: Path) -> None:
    full = load_artifacts(tiny_dir, dtype=torch.float32, cache_dir=cache)
    half = load_artifacts(tiny_dir, dtype=torch.bfloat16, cache_dir=cache)
    for name, tensor in half.weights.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, full.weights[name].to(torch.bfloat16)), name
    assert half.weights_digest == full.weights_digest
    assert half.fingerprint != full.fingerprint


def test_fingerprint_is_content_based_and_recomputable(tmp_path: Path, cache: Path) -> None:
    original = make_tiny_model("llama", tmp_path / "a", seed=1)
    first = load_artifacts(original, cache_dir=cache)
    again = load_artifacts(original, cache_dir=cache)
    moved = load_artifacts(_copy(original, tmp_path / "b"), cache_dir=tmp_path / "other-cache")
    other = load_artifacts(make_tiny_model("llama", tmp_path / "c", seed=2), cache_dir=cache)
    assert len(first.fingerprint) == 16 and len(first.weights_digest) == 16
    assert first.fingerprint == again.fingerprint == moved.fingerprint
    assert other.weights_digest != first.weights_digest and other.fingerprint != first.fingerprint
    assert first.fingerprint == model_fingerprint(
        first.weights_digest, first.config, "float32", DEFAULT_PAGE_LAYOUT, DEFAULT_CHUNK_TOKENS
    )


def test_fingerprint_covers_every_input(tmp_path: Path, cache: Path) -> None:
    artifacts = load_artifacts(make_tiny_model("qwen3", tmp_path / "m"), cache_dir=cache)
    base = (artifacts.weights_digest, artifacts.config, "float32", DEFAULT_PAGE_LAYOUT, 64)
    variants = [
        (bytes(16), *base[1:]),
        (
            base[0],
            ModelConfig.from_hf({**json.loads((tmp_path / "m" / "config.json").read_text()), "rms_norm_eps": 1e-5}),
            *base[2:],
        ),
        (*base[:2], "bfloat16", *base[3:]),
        (*base[:3], "page[layer][k|v][page_tokens=32][kv_head][head_dim]", 64),
        (*base[:4], 128),
    ]
    prints = {model_fingerprint(*base)} | {model_fingerprint(*v) for v in variants}
    assert len(prints) == 1 + len(variants)
    with pytest.raises(ValueError, match="chunk_tokens"):
        model_fingerprint(*base[:4], 0)


def test_weights_digest_follows_file_changes(tmp_path: Path, cache: Path) -> None:
    directory = make_tiny_model("llama", tmp_path / "m", seed=5)
    before = load_artifacts(directory, cache_dir=cache)
    assert not (cache / "digests").exists(), "small files are hashed on every load, not memoized"
    weights = load_file(directory / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] + 1.0
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    after = load_artifacts(directory, cache_dir=cache)
    assert after.weights_digest != before.weights_digest
    assert torch.equal(after.weights["model.norm.weight"], before.weights["model.norm.weight"] + 1.0)


def _load_error(source: Path | str, cache: Path) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_artifacts(source, cache_dir=cache)
    return str(info.value)


def test_missing_source_names_the_path_and_the_accepted_forms(tmp_path: Path, cache: Path) -> None:
    message = _load_error(tmp_path / "nowhere", cache)
    assert str(tmp_path / "nowhere") in message and "does not exist" in message and ".gguf" in message


def test_file_that_is_not_gguf_is_refused(tmp_path: Path, cache: Path) -> None:
    weights = tmp_path / "pytorch_model.bin"
    weights.write_bytes(b"\0" * 64)
    message = _load_error(weights, cache)
    assert str(weights) in message and "neither a directory nor a .gguf file" in message


def test_directory_without_config(tmp_path: Path, cache: Path) -> None:
    directory = make_tiny_model("llama", tmp_path / "m")
    (directory / "config.json").unlink()
    message = _load_error(directory, cache)
    assert str(directory / "config.json") in message and "does not exist" in message


def test_config_that_is_not_json(tmp_path: Path, cache: Path) -> None:
    directory = make_tiny_model("llama", tmp_path / "m")
    (directory / "config.json").write_text("{ not json")
    message = _load_error(directory, cache)
    assert str(directory / "config.json") in message and "not valid JSON" in message


def test_unsupported_architecture(tmp_path: Path, cache: Path) -> None:
    directory = make_tiny_model("llama", tmp_path / "m")
    raw = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**raw, "model_type": "gpt2"}))
    message = _load_error(directory, cache)
    assert str(directory / "config.json") in message and "'gpt2' is not supported" in message
    assert "gemma3" in message and "llama" in message


def test_rope_scaling_is_refused(tmp_path: Path, cache: Path) -> None:
    directory = make_tiny_model("llama", tmp_path / "m")
    raw = json.loads((directory / "config.json").read_text())
    raw["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}
    (directory / "config.json").write_text(json.dumps(raw))
    message = _load_error(directory, cache)
    assert "rope scaling ['llama3'] is not supported" in message


def test_no_safetensors(tmp_path: Path, cache: Path) -> None:
    directory = make_tiny_model("qwen2", tmp_path / "m")
    (directory / "model.safetensors").unlink()
    message = _load_error(directory, cache)
    assert str(directory) in message and "no *.safetensors" in message


def test_truncated_safetensors(tmp_path: Path, cache: Path) -> None:
    directory = make_tiny_model("qwen2", tmp_path / "m")
    path = directory / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    message = _load_error(directory, cache)
    assert str(path) in message and "truncated or corrupt" in message


def test_missing_tensor_is_named(tmp_path: Path, cache: Path) -> None:
    directory = make_tiny_model("qwen3", tmp_path / "m")
    weights = load_file(directory / "model.safetensors")
    del weights["model.layers.1.self_attn.k_norm.weight"]
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    message = _load_error(directory, cache)
    assert "missing tensors: model.layers.1.self_attn.k_norm.weight" in message
    assert str(directory) in message and "config.json that was saved with these weights" in message


def test_wrong_shape_is_named(tmp_path: Path, cache: Path) -> None:
    directory = make_tiny_model("gemma3", tmp_path / "m")
    raw = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**raw, "intermediate_size": 96}))
    message = _load_error(directory, cache)
    assert "wrong shapes: model.layers.0.mlp.gate_proj.weight (128, 64) (config implies (96, 64))" in message


def test_extra_tensor_is_refused(tmp_path: Path, cache: Path) -> None:
    directory = make_tiny_model("llama", tmp_path / "m", num_hidden_layers=3)
    raw = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": 2}))
    message = _load_error(directory, cache)
    assert "tensors the llama config does not use: model.layers.2." in message


def test_directory_without_tokenizer(tmp_path: Path, cache: Path) -> None:
    directory = make_tiny_model("llama", tmp_path / "m")
    (directory / "tokenizer.json").unlink()
    message = _load_error(directory, cache)
    assert str(directory) in message and "no tokenizer.json" in message


def test_integer_dtype_is_refused(tmp_path: Path, cache: Path) -> None:
    with pytest.raises(ModelLoadError, match="not a floating point type"):
        load_artifacts(tmp_path, dtype=torch.int8, cache_dir=cache)
