"""The weights and KV dtypes a model runs in, by name (torch-free, so the command line can offer them).

``kvrelay.worker.runtime.engine.DTYPES`` maps each name to its torch dtype; the
name is also what a model fingerprint records (``loader.dtype_name``).
"""

from __future__ import annotations

DTYPE_NAMES: tuple[str, ...] = ("float32", "bfloat16")
