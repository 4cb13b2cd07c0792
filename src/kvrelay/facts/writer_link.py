"""The store's end of its writer process: one I/O thread that sends batches and reads reports.

Contract:
- The link starts ``python -m kvrelay.facts.writer_process`` (SIGINT ignored
  there, so an interrupted server still drains its facts) and sends it the
  ``WriterConfig``. At most every ``linger_s`` (or at once after ``wake``) it
  calls ``take()`` for the items buffered since, and sends them in frames of at
  most ``batch_size`` items; it takes nothing while earlier bytes are still
  unsent, so a slow writer leaves items in the store's bounded buffer, never
  here. So the routing thread yields the interpreter lock to this thread a few
  times per ``linger_s``, not once per item.
- Each report of the writer goes to ``on_report`` (in order), on this thread.
- If the writer process ends without being asked to, the items it was sent and
  did not report are handed to ``on_lost(n, reason)``, and a new writer is
  started after ``restart_after_s``; items not yet taken are sent to it.
- ``close(timeout)``: once ``take()`` returns nothing, the writer's input is
  closed; the writer drains and exits, and the link ends. True when that
  happened within ``timeout``; otherwise the writer is killed, its unreported
  items go to ``on_lost``, and False. Items still untaken when a closing link
  ends (its writer died) also go to ``on_lost``.
- The routing path never waits on this thread: all pipe I/O is non-blocking here.
"""

from __future__ import annotations

import fcntl
import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from kvrelay.facts.wire import FrameBuffer, batch_frame, frame
from kvrelay.facts.writer_process import WriterConfig

log = logging.getLogger("kvrelay.facts.store")

_SRC = str(Path(__file__).resolve().parents[2])
"""The directory holding the ``kvrelay`` package, put first on the writer's PYTHONPATH."""


def _writer_command() -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_SRC, env.get("PYTHONPATH", "")) if p)
    return [sys.executable, "-m", "kvrelay.facts.writer_process"], env


PIPE_BYTES = 1 << 20
"""The writer's input pipe is widened to this (Linux; the default unprivileged limit), so that one linger's
items usually go out in one write: each write is a wake-up of this thread, which takes the interpreter lock
from the routing thread."""


def _widen_pipe(fd: int) -> None:
    setsize = getattr(fcntl, "F_SETPIPE_SZ", None)
    if setsize is None:
        return
    try:
        fcntl.fcntl(fd, setsize, PIPE_BYTES)
    except OSError as exc:
        log.debug("fact writer pipe keeps its size: %s", exc)


class WriterLink:
    def __init__(
        self,
        config: WriterConfig,
        take: Callable[[], list[bytes]],
        on_report: Callable[[list[Any]], None],
        on_lost: Callable[[int, str], None],
        linger_s: float,
        restart_after_s: float = 1.0,
    ) -> None:
        self._config = config
        self._take = take
        self._on_report = on_report
        self._on_lost = on_lost
        self._linger_s = linger_s
        self._restart_after_s = restart_after_s
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._fds_open = True
        self._proc: subprocess.Popen[bytes] | None = None
        self._thread = threading.Thread(target=self._run, name="kvrelay-facts-link", daemon=True)
        self._thread.start()

    @property
    def pid(self) -> int | None:
        """The current writer process, if one is running."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def wake(self) -> None:
        """Take and send what is buffered now rather than after ``linger_s``."""
        if not self._fds_open:
            return
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # a wake-up is already pending, or the link is closed

    def close(self, timeout: float) -> bool:
        self._stop.set()
        self.wake()
        self._thread.join(timeout)
        finished = not self._thread.is_alive()
        if not finished:
            proc = self._proc
            if proc is not None:
                proc.kill()
            self._thread.join(5.0)
        if not self._thread.is_alive():
            self._fds_open = False
            os.close(self._wake_r)
            os.close(self._wake_w)
        return finished

    def _run(self) -> None:
        while True:
            try:
                command, env = _writer_command()
                self._proc = proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
            except OSError as exc:
                log.error("fact writer process could not start: %s", exc)
                if self._stop.wait(self._restart_after_s):
                    self._lose_untaken()
                    return
                continue
            sent, done, asked = self._pump(proc)
            code = proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()
            if asked and code == 0 and sent == done:
                return
            self._on_lost(sent - done, f"the fact writer process exited with code {code}")
            if self._stop.is_set() or self._stop.wait(self._restart_after_s):
                self._lose_untaken()
                return

    def _lose_untaken(self) -> None:
        untaken = len(self._take())
        if untaken:
            self._on_lost(untaken, "the fact store closed without a writer process")

    def _pump(self, proc: subprocess.Popen[bytes]) -> tuple[int, int, bool]:
        """Feed one writer process until its output ends: (items sent, items reported, input closed by us)."""
        assert proc.stdin is not None and proc.stdout is not None
        in_fd, out_fd = proc.stdin.fileno(), proc.stdout.fileno()
        os.set_blocking(in_fd, False)
        _widen_pipe(in_fd)
        frames = FrameBuffer()
        pending = memoryview(frame(msgspec.msgpack.encode(self._config)))
        sent = done = 0
        input_open, asked, urgent = True, False, True
        batch = self._config.batch_size
        due = time.monotonic()
        while True:
            now = time.monotonic()
            if input_open and not pending and (urgent or now >= due or self._stop.is_set()):
                urgent, due = False, now + self._linger_s
                items = self._take()
                if items:
                    sent += len(items)
                    pending = memoryview(
                        b"".join(batch_frame(items[i : i + batch]) for i in range(0, len(items), batch))
                    )
                elif self._stop.is_set():
                    proc.stdin.close()
                    input_open, asked = False, True
            writable = [in_fd] if input_open and pending else []
            timeout = self._linger_s if pending or not input_open else max(0.0, due - now)
            readable, can_write, _ = select.select([out_fd, self._wake_r], writable, [], timeout)
            if self._wake_r in readable:
                os.read(self._wake_r, 4096)
                urgent = True
            if out_fd in readable:
                data = os.read(out_fd, 1 << 16)
                if not data:
                    return sent, done, asked
                for payload in frames.feed(data):
                    report = msgspec.msgpack.decode(payload)
                    if report[0] == "p":
                        done += report[1]
                    self._on_report(report)
            if can_write:
                try:
                    pending = pending[os.write(in_fd, pending) :]
                except BlockingIOError:
                    pass
                except (BrokenPipeError, OSError):
                    pending = memoryview(b"")  # the writer is gone: its end of output follows
                    input_open = False
