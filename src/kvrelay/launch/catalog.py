"""The router process's models: tokenizers only (never weights), offered once a worker serves them.

Contract:
- ``load_served_model(source)`` reads what the ingress needs for one model
  source (a Hugging Face directory, a ``.gguf`` file, or ``None`` for the
  default Gemma 3 270M): its name (as workers advertise it: the directory name,
  the GGUF file's stem, or the default model's name), tokenizer, architecture,
  context limit and EOS ids. A GGUF model's tokenizer and config come from the
  loader's cache entry (``cache_dir/models/<weights digest>``); when that entry
  does not exist yet it is built once by ``load_artifacts`` (the tokenizer is
  converted then) and later starts read only the cached files.
- ``ModelCatalog`` holds the loaded sources by name and the ingress's model
  table. ``learn(heartbeat)`` adds each model a worker serves to that table
  (with the largest context limit any worker reported for it); a model with no
  loaded tokenizer is logged once, naming the fix, and stays unserved.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

from kvrelay import paths
from kvrelay.api.served_model import ServedModel
from kvrelay.models.config import ModelConfig
from kvrelay.models.loading.default_model import DEFAULT_MODEL_NAME, default_gguf_path
from kvrelay.models.loading.fingerprint import weights_digest
from kvrelay.models.loading.loader import MANIFEST, load_artifacts
from kvrelay.models.loading.tokenizer import load_tokenizer
from kvrelay.models.loading.weight_layout import ModelLoadError
from kvrelay.protocol.messages import Heartbeat

log = logging.getLogger(__name__)


def load_served_model(source: str | None, cache_dir: Path | None = None) -> ServedModel:
    """Tokenizer and limits of the model at ``source`` (see the module contract)."""
    cache = cache_dir if cache_dir is not None else paths.cache_dir()
    if source is None:
        return _from_directory(_gguf_entry(default_gguf_path(cache), cache, None), DEFAULT_MODEL_NAME)
    path = Path(source).expanduser()
    if path.is_dir():
        return _from_directory(path, path.name)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _from_directory(_gguf_entry(path, cache, source), path.stem)
    raise ModelLoadError(
        f"model source {path} is neither a model directory nor a .gguf file; pass a directory "
        "with config.json and tokenizer.json, or a .gguf file"
    )


def _gguf_entry(path: Path, cache: Path, source: str | None) -> Path:
    entry = cache / "models" / weights_digest([path], cache / "digests").hex()
    if not (entry / MANIFEST).is_file():
        log.info("converting %s once (tokenizer and config are cached under %s)", path, entry)
        load_artifacts(source, cache_dir=cache)
    return entry


def _from_directory(directory: Path, name: str) -> ServedModel:
    config_path = directory / "config.json"
    try:
        config = ModelConfig.from_hf(json.loads(config_path.read_text()))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"{config_path} cannot be read ({exc}); pass the model directory the workers load"
        ) from exc
    return ServedModel(
        name,
        load_tokenizer(directory),
        config.architecture,
        config.max_position_embeddings,
        tuple(config.eos_token_ids),
    )


class ModelCatalog:
    def __init__(self, loaded: dict[str, ServedModel]) -> None:
        self.loaded = dict(loaded)
        self.served: dict[str, ServedModel] = {}
        """The ingress's model table: models some worker has announced."""
        self._warned: set[str] = set()

    def learn(self, heartbeat: Heartbeat) -> None:
        for name in heartbeat.models:
            known = self.loaded.get(name)
            if known is None:
                if name not in self._warned:
                    self._warned.add(name)
                    log.warning(
                        "worker %s serves model '%s' but this router has no tokenizer for it; restart the "
                        "router with --model SOURCE for it (loaded: %s)",
                        heartbeat.worker_id,
                        name,
                        ", ".join(sorted(self.loaded)) or "none",
                    )
                continue
            current = self.served.get(name)
            limit = heartbeat.context_limit if current is None else max(current.context_limit, heartbeat.context_limit)
            if current is None or current.context_limit != limit:
                self.served[name] = replace(known, context_limit=min(limit, known.context_limit))
                if current is None:
                    log.info("model '%s' is served (first by worker %s)", name, heartbeat.worker_id)
