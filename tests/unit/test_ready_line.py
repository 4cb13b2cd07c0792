"""The ready line (``cli.ready``): one write, so a log line from another thread cannot split it."""

from __future__ import annotations

import pytest

from kvrelay.cli.ready import say_ready


class _Writes:
    def __init__(self) -> None:
        self.writes: list[str] = []
        self.flushed = 0

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        self.flushed += 1


def test_the_ready_line_and_its_newline_are_one_write_then_flushed(monkeypatch: pytest.MonkeyPatch) -> None:
    out = _Writes()
    monkeypatch.setattr("sys.stdout", out)
    say_ready("kvrelay serve ready http=http://127.0.0.1:1")
    assert out.writes == ["kvrelay serve ready http=http://127.0.0.1:1\n"]
    assert out.flushed == 1
