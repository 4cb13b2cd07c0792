"""Where kvrelay keeps files on this machine.

``cache_dir()`` holds what can be rebuilt (assembled GGUF files, dequantized
weights, converted tokenizers); ``data_dir()`` holds what the user keeps (the
embedded fact store, chunk files). ``KVRELAY_CACHE_DIR`` and
``KVRELAY_DATA_DIR`` override the defaults ``~/.cache/kvrelay`` and
``~/.local/share/kvrelay``. Neither function creates the directory.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "KVRELAY_CACHE_DIR"
DATA_ENV = "KVRELAY_DATA_DIR"


def cache_dir() -> Path:
    """The cache directory: ``$KVRELAY_CACHE_DIR`` if set and non-empty, else ``~/.cache/kvrelay``."""
    override = os.environ.get(CACHE_ENV)
    return Path(override).expanduser() if override else Path.home() / ".cache" / "kvrelay"


def data_dir() -> Path:
    """The data directory: ``$KVRELAY_DATA_DIR`` if set and non-empty, else ``~/.local/share/kvrelay``."""
    override = os.environ.get(DATA_ENV)
    return Path(override).expanduser() if override else Path.home() / ".local" / "share" / "kvrelay"
