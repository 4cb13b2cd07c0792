"""Model artifacts: weights, config, tokenizer and fingerprint, from one source.

``load_artifacts(source, dtype, cache_dir)`` accepts ``None`` (the default
Gemma 3 270M, assembled on first use), a Hugging Face directory
(``config.json`` + ``*.safetensors`` + ``tokenizer.json``), or a ``.gguf``
file. A GGUF file is dequantized once: its Hugging Face form (float32
``model.safetensors``, ``config.json``, ``tokenizer.json`` and chat template,
loadable by ``transformers`` too) is cached under
``cache_dir/models/<weights digest>/`` and later loads read only that.
Every failure raises ``ModelLoadError`` naming the file and the fix.

The weights digest is the blake2b-128 of the source's weight files' bytes
(``fingerprint.weights_digest``): content-based so hosts agree, memoized per
file under ``cache_dir/digests`` (GGUF files, and safetensors files of 64 MiB
or more) so an unchanged large file is hashed once.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerFast

from kvrelay import paths
from kvrelay.models.config import ModelConfig, UnsupportedModelError
from kvrelay.models.kernels.huge_pages import copy_to_huge_pages
from kvrelay.models.loading.default_model import DEFAULT_MODEL_NAME, default_gguf_path
from kvrelay.models.loading.fingerprint import (
    DEFAULT_PAGE_LAYOUT,
    model_fingerprint,
    weights_digest,
)
from kvrelay.models.loading.weight_layout import ModelLoadError, check_weights
from kvrelay.protocol.chunk_keys import DEFAULT_CHUNK_TOKENS

__all__ = ["LoadedArtifacts", "ModelLoadError", "dtype_name", "load_artifacts", "model_directory"]

log = logging.getLogger(__name__)

CACHE_FORMAT = 1
MEMO_MIN_BYTES = 64 << 20  # smaller safetensors files hash in well under 0.1 s: no memo files for them
MANIFEST = "kvrelay-cache.json"


@dataclass(frozen=True, eq=False)
class LoadedArtifacts:
    """One loaded model.

    ``weights`` holds exactly the tensors of ``checkpoint.expected_tensor_shapes(config)``
    in ``dtype``; ``model_dir`` is a Hugging Face directory with these weights (the
    source directory, or the cache entry of a GGUF file); ``fingerprint`` is
    ``model_fingerprint(weights_digest, config, dtype_name(dtype), DEFAULT_PAGE_LAYOUT,
    DEFAULT_CHUNK_TOKENS)``: a worker with another KV dtype, page layout or chunk size
    recomputes it from ``weights_digest``. Float32 weights read from float32 files are
    memory-mapped from ``model_dir`` (copy-on-write): replace those files, never
    rewrite them in place, while the weights are in use. Weights converted to another
    dtype are copies on huge pages (``huge_pages``). Equality is identity; the
    repr leaves out the tensors and the tokenizer.
    """

    name: str
    source: str
    config: ModelConfig
    weights: dict[str, torch.Tensor] = field(repr=False)
    tokenizer: PreTrainedTokenizerFast = field(repr=False)
    fingerprint: bytes = field(repr=False)
    weights_digest: bytes = field(repr=False)
    model_dir: Path = field(repr=False)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def load_artifacts(
    source: str | Path | None = None, dtype: torch.dtype = torch.float32, cache_dir: Path | None = None
) -> LoadedArtifacts:
    """Load the model at ``source`` (see the module docstring) with weights in ``dtype``."""
    if not dtype.is_floating_point:
        raise ModelLoadError(f"dtype {dtype} is not a floating point type; use torch.float32 or torch.bfloat16")
    cache = Path(cache_dir) if cache_dir is not None else paths.cache_dir()
    started = time.perf_counter()
    if source is None:
        artifacts = _load_gguf(default_gguf_path(cache), dtype, cache, DEFAULT_MODEL_NAME)
    else:
        path = Path(source).expanduser()
        if path.is_dir():
            digest = weights_digest(_safetensors_files(path), cache / "digests", MEMO_MIN_BYTES)
            artifacts = _load_directory(path, dtype, digest, path.name, str(path))
        elif path.is_file() and path.suffix.lower() == ".gguf":
            artifacts = _load_gguf(path, dtype, cache, path.stem)
        elif path.exists():
            raise ModelLoadError(
                f"model source {path} is neither a directory nor a .gguf file; pass a directory with "
                "config.json and *.safetensors, or a .gguf file"
            )
        else:
            raise ModelLoadError(
                f"model source {path} does not exist; pass a directory with config.json and *.safetensors, "
                "or a .gguf file (or nothing, for the default Gemma 3 270M)"
            )
    log.info("loaded %s from %s in %.2f s", artifacts.name, artifacts.source, time.perf_counter() - started)
    return artifacts


def model_directory(source: str | Path | None = None, cache_dir: Path | None = None) -> Path:
    """The Hugging Face directory holding the weights of ``source`` (as ``load_artifacts`` takes it): a directory
    itself, or the cache entry of a GGUF file (the default model's for ``None``), converted once on first use.
    Another engine (vLLM) serves the same weights from it; nothing is loaded into memory."""
    cache = Path(cache_dir) if cache_dir is not None else paths.cache_dir()
    if source is None:
        return _gguf_entry(default_gguf_path(cache), cache)[0]
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _gguf_entry(path, cache)[0]
    raise ModelLoadError(
        f"model source {path} is neither a directory nor a .gguf file; pass a directory with config.json and "
        "*.safetensors, or a .gguf file (or nothing, for the default Gemma 3 270M)"
    )


def _safetensors_files(directory: Path) -> list[Path]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"{directory} has no *.safetensors files; save the model with save_pretrained (safetensors) "
            "or pass a .gguf file"
        )
    return files


def _read_config(directory: Path) -> ModelConfig:
    path = directory / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{path} does not exist; a model directory needs the config.json saved with its weights")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(
            f"{path} is not valid JSON ({exc}); restore the config.json saved with the weights"
        ) from exc
    try:
        config = ModelConfig.from_hf(raw)
    except UnsupportedModelError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    _reject_rope_scaling(raw, path)
    return config


def _reject_rope_scaling(raw: dict[str, Any], path: Path) -> None:
    """``ModelConfig`` has no rope scaling: a config that asks for it would run with wrong positions."""
    text = raw.get("text_config") or raw
    params = [text.get("rope_scaling"), text.get("rope_parameters")]
    nested = [p for p in params if isinstance(p, dict)]
    nested += [v for p in nested for v in p.values() if isinstance(v, dict)]
    kinds = {str(p.get("rope_type") or p.get("type")) for p in nested if (p.get("rope_type") or p.get("type"))}
    if kinds - {"default"}:
        raise ModelLoadError(
            f"{path}: rope scaling {sorted(kinds - {'default'})} is not supported; use a model without rope scaling"
        )


def _read_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            weights.update(load_file(file))
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelLoadError(
                f"{file} cannot be read ({exc}); it may be truncated or corrupt: save or copy it again"
            ) from exc
    return weights


def _load_directory(directory: Path, dtype: torch.dtype, digest: bytes, name: str, source: str) -> LoadedArtifacts:
    from kvrelay.models.loading.tokenizer import load_tokenizer

    config = _read_config(directory)
    checked = check_weights(_read_safetensors(_safetensors_files(directory)), config, str(directory))
    weights = {k: v if v.dtype == dtype else copy_to_huge_pages(v, dtype) for k, v in checked.items()}
    return LoadedArtifacts(
        name=name,
        source=source,
        config=config,
        weights=weights,
        tokenizer=load_tokenizer(directory),
        fingerprint=model_fingerprint(digest, config, dtype_name(dtype), DEFAULT_PAGE_LAYOUT, DEFAULT_CHUNK_TOKENS),
        weights_digest=digest,
        model_dir=directory,
    )


def _load_gguf(path: Path, dtype: torch.dtype, cache: Path, name: str) -> LoadedArtifacts:
    entry, digest = _gguf_entry(path, cache)
    return _load_directory(entry, dtype, digest, name, str(path))


def _gguf_entry(path: Path, cache: Path) -> tuple[Path, bytes]:
    """The cache entry of the GGUF file ``path`` (``cache/models/<weights digest>``, built if incomplete) and
    that digest."""
    digest = weights_digest([path], cache / "digests")
    entry = cache / "models" / digest.hex()
    if not _cache_entry_complete(entry):
        _build_cache_entry(path, entry, digest)
    return entry, digest


def _cache_entry_complete(entry: Path) -> bool:
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return manifest.get("format") == CACHE_FORMAT


def _build_cache_entry(path: Path, entry: Path, digest: bytes) -> None:
    """Dequantize ``path`` into a fresh directory, then rename it to ``entry`` (the manifest is written last)."""
    from safetensors.torch import save_file

    from kvrelay.models.loading.gguf import read_gguf
    from kvrelay.models.loading.tokenizer import convert_gguf_tokenizer

    started = time.perf_counter()
    building = entry.with_name(f"{entry.name}.building-{time.time_ns()}")
    building.mkdir(parents=True)
    try:
        model = read_gguf(path)
        save_file(model.weights, building / "model.safetensors", metadata={"format": "pt"})
        (building / "config.json").write_text(json.dumps(model.config, indent=2, sort_keys=True))
        convert_gguf_tokenizer(path, building, ModelConfig.from_hf(model.config).architecture)
        manifest = {"format": CACHE_FORMAT, "source": str(path), "weights_digest": digest.hex()}
        (building / MANIFEST).write_text(json.dumps(manifest, indent=2))
        if not _cache_entry_complete(entry):
            shutil.rmtree(entry, ignore_errors=True)
            building.rename(entry)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    log.info("cached %s as %s in %.1f s", path, entry, time.perf_counter() - started)
