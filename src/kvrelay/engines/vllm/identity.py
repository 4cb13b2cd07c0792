"""The model fingerprint of a vLLM-served model, and the KV bytes per token of its config.

A vLLM engine's KV is not interchangeable with a native worker's (another
page layout, other kernels, other numerics), so its chunk chains must never
meet a native worker's: ``engine_fingerprint`` is a 16-byte blake2b digest
under its own version tag (``FINGERPRINT_VERSION``) over length-prefixed
fields: the weights digest of the model directory's weight files
(``models/loading/fingerprint.py`` ``weights_digest``), the canonical JSON of
its ``config.json``, the engine (``vllm <version>``), the dtype and the block
size. Two vLLM workers serving the same files with the same engine version,
dtype and block size share chains, so the router credits one's resident
prefix against the other's; a native worker of the same model never does.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from kvrelay.models.config import ModelConfig
from kvrelay.models.loading.fingerprint import DIGEST_BYTES, weights_digest

FINGERPRINT_VERSION = b"kvrelay-vllm-engine-fingerprint-v1"
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.gguf")


class EngineModelError(ValueError):
    """A model directory a vLLM worker cannot fingerprint."""


def _field(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


def engine_fingerprint(
    model_dir: Path, vllm_version: str, dtype: str, block_tokens: int, memo_dir: Path | None = None
) -> bytes:
    """The fingerprint of ``model_dir`` served by vLLM ``vllm_version`` (see the module docstring)."""
    config_path = model_dir / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise EngineModelError(f"{config_path} cannot be read ({exc}); pass the directory vLLM serves") from None
    files = [p for pattern in WEIGHT_PATTERNS for p in model_dir.glob(pattern)]
    if not files:
        raise EngineModelError(f"{model_dir} holds no weight files ({', '.join(WEIGHT_PATTERNS)})")
    h = hashlib.blake2b(FINGERPRINT_VERSION, digest_size=DIGEST_BYTES)
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    for part in (weights_digest(files, memo_dir, 1 << 20), canonical, f"vllm {vllm_version}".encode(), dtype.encode()):
        h.update(_field(part))
    h.update(struct.pack("<I", block_tokens))
    return h.digest()


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "half": 2, "float": 4}


def kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    """KV bytes one token takes in the engine: layers x (K, V) x KV heads x head size x dtype bytes."""
    config = ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    return config.kv_bytes_per_token(DTYPE_BYTES.get(dtype, 2))
