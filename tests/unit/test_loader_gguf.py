"""Loading tiny GGUF files written with gguf.GGUFWriter in llama.cpp's conventions."""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvrelay.models.config import ModelConfig
from kvrelay.models.loading.loader import MANIFEST, load_artifacts
from kvrelay.models.loading.tokenizer import GEMMA_CHAT_TEMPLATE
from kvrelay.models.loading.weight_layout import ModelLoadError
from kvrelay.testing.tiny_models import (
    TINY_ARCHITECTURES,
    TINY_CHAT_TEMPLATE,
    make_tiny_model,
)
from tests.support.tiny_gguf import write_tiny_gguf

GGUF_ARCHS = TINY_ARCHITECTURES
TEXT = "the capital of France is Paris"


def _tiny(arch: str, directory: Path) -> Path:
    # GGUF metadata has no query_pre_attn_scalar; llama.cpp uses head_dim, so the tiny model does too.
    overrides = {"query_pre_attn_scalar": 32} if arch == "gemma3" else {}
    return make_tiny_model(arch, directory, seed=21, **overrides)


@pytest.fixture(scope="module", params=GGUF_ARCHS)
def hf_and_gguf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp(f"gguf-{request.param}")
    model_dir = _tiny(request.param, root / "hf")
    return model_dir, write_tiny_gguf(model_dir, root / f"tiny-{request.param}.gguf")


def _raw_gguf_tensor(path: Path, name: str) -> torch.Tensor:
    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    return torch.tensor(gguf.quants.dequantize(tensor.data, tensor.tensor_type))


def test_gguf_weights_equal_the_hf_weights(hf_and_gguf: tuple[Path, Path], tmp_path: Path) -> None:
    model_dir, path = hf_and_gguf
    artifacts = load_artifacts(path, cache_dir=tmp_path)
    reference = load_file(model_dir / "model.safetensors")
    assert set(artifacts.weights) == set(reference)
    for name, tensor in artifacts.weights.items():
        # Gemma norms pass through 1 + w and back in float32: one rounding step at most.
        assert torch.allclose(tensor, reference[name], rtol=0, atol=1e-6), name
    assert artifacts.name == path.stem and artifacts.source == str(path)


def test_gemma_norms_are_stored_as_one_plus_w(tmp_path: Path) -> None:
    model_dir = _tiny("gemma3", tmp_path / "hf")
    path = write_tiny_gguf(model_dir, tmp_path / "g.gguf")
    reference = load_file(model_dir / "model.safetensors")
    artifacts = load_artifacts(path, cache_dir=tmp_path / "cache")
    for gguf_name, hf_name in [
        ("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
        ("blk.2.post_ffw_norm.weight", "model.layers.2.post_feedforward_layernorm.weight"),
        ("blk.5.attn_q_norm.weight", "model.layers.5.self_attn.q_norm.weight"),
        ("output_norm.weight", "model.norm.weight"),
    ]:
        stored = _raw_gguf_tensor(path, gguf_name)
        assert torch.allclose(stored, reference[hf_name] + 1.0, atol=1e-6), gguf_name
        assert torch.allclose(artifacts.weights[hf_name], reference[hf_name], atol=1e-6), hf_name


def test_llama_q_and_k_rows_are_unpermuted(tmp_path: Path) -> None:
    model_dir = _tiny("llama", tmp_path / "hf")
    path = write_tiny_gguf(model_dir, tmp_path / "l.gguf")
    reference = load_file(model_dir / "model.safetensors")
    artifacts = load_artifacts(path, cache_dir=tmp_path / "cache")
    for proj, gguf_name in [("q_proj", "blk.1.attn_q.weight"), ("k_proj", "blk.1.attn_k.weight")]:
        hf_name = f"model.layers.1.self_attn.{proj}.weight"
        assert not torch.equal(_raw_gguf_tensor(path, gguf_name), reference[hf_name]), "the GGUF stores it permuted"
        assert torch.equal(artifacts.weights[hf_name], reference[hf_name])


# transformers reads no attention.key_length for qwen3 GGUFs (it assumes Qwen3Config's default head_dim 128),
# so the tiny Qwen3 (head_dim 32) is compared with its safetensors only, in the tests above.
@pytest.mark.parametrize("arch", ["gemma3", "llama", "qwen2"])
def test_q8_0_gguf_matches_transformers_gguf_loading(arch: str, tmp_path: Path) -> None:
    model_dir = _tiny(arch, tmp_path / "hf")
    path = write_tiny_gguf(model_dir, tmp_path / "q8.gguf", quantize=True)
    artifacts = load_artifacts(path, cache_dir=tmp_path / "cache")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).state_dict()
    reference = load_file(model_dir / "model.safetensors")
    for name, tensor in artifacts.weights.items():
        assert torch.equal(tensor, theirs[name]), name
        assert torch.allclose(tensor, reference[name], atol=0.3 / 127 * 4), name
    quantized = reference["model.layers.0.mlp.up_proj.weight"]
    assert not torch.equal(artifacts.weights["model.layers.0.mlp.up_proj.weight"], quantized), "Q8_0 was stored"


def test_gguf_config_follows_llama_cpp(hf_and_gguf: tuple[Path, Path], tmp_path: Path) -> None:
    model_dir, path = hf_and_gguf
    config = load_artifacts(path, cache_dir=tmp_path).config
    expected = ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    assert config.architecture == expected.architecture
    for field in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "rope_theta",
        "tie_word_embeddings",
        "layer_types",
        "sliding_window",
        "rope_local_theta",
        "query_pre_attn_scalar",
        "qk_norm",
        "attention_bias",
        "bos_token_id",
        "hidden_activation",
    ):
        assert getattr(config, field) == getattr(expected, field), field
    assert config.rms_norm_eps == pytest.approx(expected.rms_norm_eps)
    expected_eos = (1, 5) if config.architecture == "gemma3" else (1,)  # Gemma adds <end_of_turn>
    assert config.eos_token_ids == expected_eos


def test_gguf_tokenizer_matches_transformers_conversion(hf_and_gguf: tuple[Path, Path], tmp_path: Path) -> None:
    _, path = hf_and_gguf
    artifacts = load_artifacts(path, cache_dir=tmp_path)
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ids = artifacts.tokenizer(TEXT).input_ids
    assert ids == reference(TEXT).input_ids and ids[0] == 2
    assert artifacts.tokenizer.decode(ids, skip_special_tokens=True) == TEXT


def test_gguf_chat_template_is_kept_and_gemma_gets_one(tmp_path: Path) -> None:
    gemma = write_tiny_gguf(_tiny("gemma3", tmp_path / "g"), tmp_path / "g.gguf")
    llama = _tiny("llama", tmp_path / "l")
    with_template = write_tiny_gguf(llama, tmp_path / "l.gguf", chat_template=TINY_CHAT_TEMPLATE)
    without = write_tiny_gguf(llama, tmp_path / "plain.gguf")
    assert load_artifacts(gemma, cache_dir=tmp_path / "c").tokenizer.chat_template == GEMMA_CHAT_TEMPLATE
    assert load_artifacts(with_template, cache_dir=tmp_path / "c").tokenizer.chat_template == TINY_CHAT_TEMPLATE
    assert not load_artifacts(without, cache_dir=tmp_path / "c").tokenizer.chat_template
    chat = load_artifacts(gemma, cache_dir=tmp_path / "c").tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert chat == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"


def test_second_load_reads_the_cache_not_the_gguf(tmp_path: Path) -> None:
    model_dir = _tiny("gemma3", tmp_path / "hf")
    path = write_tiny_gguf(model_dir, tmp_path / "g.gguf")
    first = load_artifacts(path, cache_dir=tmp_path / "cache")
    entry = first.model_dir
    assert entry.parent == tmp_path / "cache" / "models" and entry.name == first.weights_digest.hex()
    assert {"model.safetensors", "config.json", "tokenizer.json", MANIFEST} <= {p.name for p in entry.iterdir()}
    # Overwrite the tensor data but keep size and mtime: only a load from the cache still sees the weights.
    stat = path.stat()
    blob = bytearray(path.read_bytes())
    blob[-4096:] = bytes(4096)
    path.write_bytes(bytes(blob))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    second = load_artifacts(path, cache_dir=tmp_path / "cache")
    assert second.fingerprint == first.fingerprint
    for name, tensor in second.weights.items():
        assert torch.equal(tensor, first.weights[name]), name
    # The cache entry is an ordinary Hugging Face directory.
    theirs = AutoModelForCausalLM.from_pretrained(entry, dtype=torch.float32).state_dict()
    assert torch.equal(
        theirs["model.layers.0.input_layernorm.weight"], first.weights["model.layers.0.input_layernorm.weight"]
    )


def test_incomplete_cache_entry_is_rebuilt(tmp_path: Path) -> None:
    path = write_tiny_gguf(_tiny("llama", tmp_path / "hf"), tmp_path / "l.gguf")
    first = load_artifacts(path, cache_dir=tmp_path / "cache")
    lm_head = first.weights["lm_head.weight"].clone()  # the loaded weights map the file about to be clobbered
    (first.model_dir / MANIFEST).unlink()
    (first.model_dir / "model.safetensors").write_bytes(b"partial")
    second = load_artifacts(path, cache_dir=tmp_path / "cache")
    assert (second.model_dir / MANIFEST).is_file()
    assert torch.equal(second.weights["lm_head.weight"], lm_head)


def test_bfloat16_from_gguf(tmp_path: Path) -> None:
    path = write_tiny_gguf(_tiny("gemma3", tmp_path / "hf"), tmp_path / "g.gguf")
    full = load_artifacts(path, cache_dir=tmp_path / "cache")
    half = load_artifacts(path, dtype=torch.bfloat16, cache_dir=tmp_path / "cache")
    assert all(t.dtype == torch.bfloat16 for t in half.weights.values())
    assert torch.equal(half.weights["model.embed_tokens.weight"], full.weights["model.embed_tokens.weight"].bfloat16())


def _gguf_error(path: Path, cache: Path) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_artifacts(path, cache_dir=cache)
    return str(info.value)


def test_truncated_gguf(tmp_path: Path) -> None:
    path = write_tiny_gguf(_tiny("llama", tmp_path / "hf"), tmp_path / "t.gguf")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    message = _gguf_error(path, tmp_path / "cache")
    assert str(path) in message and "truncated or corrupt" in message
    assert not (tmp_path / "cache" / "models").exists() or not any((tmp_path / "cache" / "models").iterdir())


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"this is not a gguf file" * 10)
    message = _gguf_error(path, tmp_path / "cache")
    assert str(path) in message and "not a readable GGUF file" in message


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(8, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    message = _gguf_error(path, tmp_path / "cache")
    assert str(path) in message and "'gpt2' is not supported" in message and "gemma3" in message


def test_gguf_missing_tensor_is_named(tmp_path: Path) -> None:
    model_dir = _tiny("gemma3", tmp_path / "hf")
    path = write_tiny_gguf(model_dir, tmp_path / "m.gguf", drop=["model.layers.3.mlp.down_proj.weight"])
    message = _gguf_error(path, tmp_path / "cache")
    assert str(path) in message and "missing tensors: model.layers.3.mlp.down_proj.weight" in message


def test_gguf_without_tokenizer(tmp_path: Path) -> None:
    path = write_tiny_gguf(_tiny("llama", tmp_path / "hf"), tmp_path / "n.gguf", with_tokenizer=False)
    message = _gguf_error(path, tmp_path / "cache")
    assert str(path) in message and "no tokenizer" in message
