"""A progress bar on stderr: ``tqdm`` when it is installed, else a one-line text bar."""

from __future__ import annotations

import sys
from typing import Any


class ProgressBar:
    def __init__(self, total: int, enabled: bool = True) -> None:
        self.total = total
        self.done = 0
        self.enabled = enabled
        self._tqdm: Any = None
        if enabled:
            try:
                from tqdm import tqdm

                self._tqdm = tqdm(total=total, unit="req", file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                self._tqdm = None

    def update(self, stage: str, requests: int) -> None:
        """Show ``stage`` and count ``requests`` more finished requests (thread-safe enough for a display)."""
        self.done += requests
        if not self.enabled:
            return
        if self._tqdm is not None:
            self._tqdm.set_description(stage, refresh=False)
            self._tqdm.update(requests)
            return
        width = 30
        filled = width * min(self.done, self.total) // max(1, self.total)
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {stage[:40]:<40}")
        sys.stderr.flush()

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()
        elif self.enabled:
            sys.stderr.write("\n")
