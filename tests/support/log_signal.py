"""A logging handler that sets an event when a message contains a given text."""

from __future__ import annotations

import logging
import threading


class LogSignal(logging.Handler):
    """Sets ``seen`` when a log message contains ``needle``."""

    def __init__(self, needle: str) -> None:
        super().__init__()
        self.needle, self.seen = needle, threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.needle in record.getMessage():
            self.seen.set()
