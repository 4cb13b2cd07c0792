"""The fact writer: a process of its own that validates buffered facts and writes them in batches.

Run by ``FactStore`` as ``python -m kvrelay.facts.writer_process``; the database
work (validation, JSON encoding, SQLAlchemy, the driver) never holds the
router's interpreter lock. Protocol (frames of ``wire``): stdin carries a
``WriterConfig`` (msgpack) and then batch frames; stdout carries reports, each
a msgpack array: ``["p", items processed, {counter: delta}]`` whenever the
writer has caught up with its input (and every ``REPORT_EVERY_S`` while it has
not), and ``["l", level, text]`` for a log line (already throttled per category: the
first five, then every thousandth; the counters are exact). Stdin's end means
close: what is buffered is drained, giving up at the first failure, and the
process exits 0.

Writing (``Writer.write_batch``):
- each item is validated (``records.to_writes``): an unknown kind is counted in
  ``unknown_kinds``, malformed data (and a ``wire.Invalid``) in ``rejected``,
  each logged with the reason; neither stops the writer;
- a batch is written in one transaction with one driver ``executemany`` per
  group of same-operation writes (``batch_plan``: offer outcomes folded into
  their decisions' inserts where the batch holds both, then lanes in
  ``records.OPS`` order, order kept within a lane);
- a batch that fails for a database reason (down, locked, read-only, schema
  missing) is retried with exponential backoff up to ``max_retries`` times,
  then dropped and counted in ``dropped`` (every failed attempt is counted in
  ``failed_attempts``); one that fails for a data reason (a constraint, a value
  the database refuses) is retried row by row, unfolded, so only the bad rows
  are rejected;
- the schema is created before the first write (and after any failure).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import sqlalchemy as sa

from kvrelay.core.router.events import Record
from kvrelay.facts.batch_plan import IndexedWrite, fold_offer_outcomes, plan_groups
from kvrelay.facts.engine import create_schema, make_engine
from kvrelay.facts.records import Fact, MalformedRecord, UnknownKind, to_writes
from kvrelay.facts.statements import driver_statements
from kvrelay.facts.wire import FrameBuffer, Invalid, decode_items, frame

REPORT_EVERY_S = 0.1
"""While a backlog lasts, progress is reported this often (and whenever the writer has caught up)."""

COUNTERS = ("written", "rejected", "unknown_kinds", "dropped", "failed_attempts", "writer_busy_us")
"""The counters a writer reports (deltas); the store adds them to its own. ``writer_busy_us``: microseconds spent
validating and writing batches (wall clock), so written items per busy second is what the writer can sustain."""

WRITER_NICENESS = 5
"""How much nicer than its parent the writer runs (``os.nice``): a busy CPU serves routing first."""


class WriterConfig(msgspec.Struct, frozen=True):
    url: str
    connect_timeout_s: float
    batch_size: int
    max_retries: int
    backoff_s: float
    backoff_max_s: float


def is_data_error(exc: BaseException) -> bool:
    """True for errors that retrying the same rows cannot fix: constraints, bad values, unbindable parameters."""
    if isinstance(exc, (sa.exc.IntegrityError, sa.exc.DataError)):
        return True
    return isinstance(exc, sa.exc.StatementError) and not isinstance(exc, sa.exc.DBAPIError)


class Throttle:
    """Emits the first five messages of each category, then every 1000th, with its count."""

    def __init__(self, emit: Callable[[int, str], None]) -> None:
        self._counts: dict[str, int] = {}
        self._emit = emit

    def log(self, level: int, category: str, message: str, *args: Any) -> None:
        n = self._counts[category] = self._counts.get(category, 0) + 1
        if n <= 5 or n % 1000 == 0:
            self._emit(level, (message + " (%s #%d)") % (*args, category, n))


class Writer:
    """Writes batches of items to one database (see the module docstring); counts into ``counts``."""

    def __init__(self, config: WriterConfig, emit: Callable[[int, str], None], closing: threading.Event) -> None:
        self.config = config
        self.engine = make_engine(config.url, connect_timeout_s=config.connect_timeout_s)
        self.counts = dict.fromkeys(COUNTERS, 0)
        self._statements = driver_statements(self.engine.dialect.name)
        self._throttle = Throttle(emit)
        self._closing = closing
        self._give_up = False
        self._schema_ready = False

    def take_counts(self) -> dict[str, int]:
        """The counters since the last call (non-zero ones only)."""
        out = {k: v for k, v in self.counts.items() if v}
        self.counts = dict.fromkeys(COUNTERS, 0)
        return out

    def _validated(self, batch: list[Record | Fact | Invalid]) -> list[IndexedWrite]:
        writes: list[IndexedWrite] = []
        for index, item in enumerate(batch):
            try:
                if isinstance(item, Invalid):
                    raise MalformedRecord(item.message)
                writes.extend((index, w) for w in to_writes(item))
            except UnknownKind as exc:
                self.counts["unknown_kinds"] += 1
                self._throttle.log(logging.WARNING, "unknown_kind", "fact store ignored %s", exc)
            except MalformedRecord as exc:
                self.counts["rejected"] += 1
                self._throttle.log(logging.WARNING, "malformed", "fact store rejected %s", exc)
        return writes

    def write_batch(self, batch: list[Record | Fact | Invalid]) -> None:
        writes = self._validated(batch)
        items = {index for index, _ in writes}
        if not items:
            return
        if self._give_up:
            self.counts["dropped"] += len(items)
            return
        groups = plan_groups(fold_offer_outcomes(writes))
        for attempt in range(self.config.max_retries + 1):
            try:
                self._execute(groups)
                self.counts["written"] += len(items)
                return
            except (sa.exc.SQLAlchemyError, OSError) as exc:
                if is_data_error(exc):
                    self._throttle.log(
                        logging.WARNING, "data_error", "fact batch hit a data error, writing row by row: %s", exc
                    )
                    self._write_rows(writes)
                    return
                self._schema_ready = False
                self.counts["failed_attempts"] += 1
                closing = self._closing.is_set()
                if closing or attempt == self.config.max_retries:
                    self._give_up = closing
                    self.counts["dropped"] += len(items)
                    where = self.engine.url.render_as_string(hide_password=True)
                    self._throttle.log(
                        logging.ERROR,
                        "dropped",
                        "fact store %s unavailable; dropped %d items after %d attempts: %s",
                        where,
                        len(items),
                        attempt + 1,
                        exc,
                    )
                    return
                delay = min(self.config.backoff_max_s, self.config.backoff_s * 2**attempt)
                self._throttle.log(
                    logging.WARNING, "unavailable", "fact store write failed, retrying in %.2fs: %s", delay, exc
                )
                self._closing.wait(delay)

    def _execute(self, groups: list[tuple[str, list[IndexedWrite]]]) -> None:
        if not self._schema_ready:
            create_schema(self.engine)
            self._schema_ready = True
        with self.engine.begin() as conn:
            for op, group in groups:
                conn.exec_driver_sql(self._statements[op], [w.params for _, w in group])

    def _write_rows(self, writes: list[IndexedWrite]) -> None:
        failed: set[int] = set()
        for index, write in writes:
            if index in failed:
                continue
            try:
                with self.engine.begin() as conn:
                    conn.exec_driver_sql(self._statements[write.op], write.params)
            except (sa.exc.SQLAlchemyError, OSError) as exc:
                failed.add(index)
                self._throttle.log(logging.WARNING, "row_rejected", "fact store rejected one %s row: %s", write.op, exc)
        self.counts["rejected"] += len(failed)
        self.counts["written"] += len({index for index, _ in writes} - failed)


def _read_frames(fd: int, frames: FrameBuffer, inbox: queue.SimpleQueue[Any], closing: threading.Event) -> None:
    """Decoded batches from ``fd`` into ``inbox`` until its end, then None (and ``closing`` set)."""
    try:
        while data := os.read(fd, 1 << 20):
            for payload in frames.feed(data):
                inbox.put(decode_items(payload))
    finally:
        closing.set()
        inbox.put(None)


def _send(fd: int, message: Any) -> None:
    view = memoryview(frame(msgspec.msgpack.encode(message)))
    while view:
        view = view[os.write(fd, view) :]


def _read_config(fd: int, frames: FrameBuffer) -> tuple[bytes | None, list[bytes]]:
    """The first frame's payload (None if the input ended first) and any frames read with it."""
    while data := os.read(fd, 1 << 16):
        if payloads := frames.feed(data):
            return payloads[0], payloads[1:]
    return None, []


def serve(in_fd: int, out_fd: int) -> int:
    """Read the config, then write batches until the input ends; 0 when drained, 2 without a config."""
    frames = FrameBuffer()
    first, early = _read_config(in_fd, frames)
    if first is None:
        return 2
    config = msgspec.msgpack.decode(first, type=WriterConfig)
    closing = threading.Event()
    writer = Writer(config, lambda level, text: _send(out_fd, ("l", level, text)), closing)
    inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
    for payload in early:
        inbox.put(decode_items(payload))
    threading.Thread(target=_read_frames, args=(in_fd, frames, inbox, closing), daemon=True).start()
    carry: list[Any] | None = None
    ended = False
    unreported, reported_at = 0, time.monotonic()
    while not ended:
        batch = carry if carry is not None else inbox.get()
        carry = None
        if batch is None:
            break
        while len(batch) < config.batch_size:
            try:
                more = inbox.get_nowait()
            except queue.Empty:
                break
            if more is None:
                ended = True
                break
            if len(batch) + len(more) > config.batch_size:
                carry = more
                break
            batch = batch + more
        started = time.perf_counter()
        try:
            writer.write_batch(batch)
        except Exception as exc:  # the writer survives everything; the batch is counted as dropped
            writer.counts["dropped"] += len(batch)
            _send(out_fd, ("l", logging.ERROR, f"fact writer: unexpected error; {len(batch)} items dropped: {exc!r}"))
        writer.counts["writer_busy_us"] += round((time.perf_counter() - started) * 1e6)
        unreported += len(batch)
        now = time.monotonic()
        if carry is None and inbox.empty() or now - reported_at >= REPORT_EVERY_S:
            _send(out_fd, ("p", unreported, writer.take_counts()))
            unreported, reported_at = 0, now
    if unreported:
        _send(out_fd, ("p", unreported, writer.take_counts()))
    writer.engine.dispose()
    return 0


def main() -> int:
    """Protocol on private copies of stdin and stdout; stray output of libraries goes to stderr.

    SIGINT is ignored: an interrupted store closes this writer's input, and the writer drains.
    The process runs ``WRITER_NICENESS`` steps nicer than its parent: when the CPU is
    short, routing (unbuffered) runs before fact writing (buffered, in batches).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.nice(WRITER_NICENESS)
    in_fd, out_fd = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(2, 1)
    try:
        return serve(in_fd, out_fd)
    except BrokenPipeError:
        return 0  # the store is gone: nobody is left to report to


if __name__ == "__main__":
    sys.exit(main())
