"""Fact records the store cannot write are counted on ``/metrics``: a server whose SQLite file lies on a
really full filesystem (a small tmpfs this test mounts and fills) keeps serving, and ``/metrics`` shows
every record the writer gave up on; once space is free again, records are written again."""

from __future__ import annotations

import contextlib
import re
import sqlite3
from pathlib import Path

import httpx
import pytest

from kvrelay.testing.tiny_models import make_tiny_model
from tests.support.processes import complete, wait_until
from tests.support.server_thread import ServerThread
from tests.support.small_fs import fill, small_tmpfs

pytestmark = pytest.mark.timeout(180)

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12] * 4


def scrape(base_url: str) -> dict[str, float]:
    """Every sample of ``/metrics`` by its name and labels as written."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\S+) (\S+)$", text, re.MULTILINE)}


def outcome_rows(db: Path) -> int:
    with contextlib.closing(sqlite3.connect(db)) as con:
        return int(con.execute("select count(*) from outcomes").fetchone()[0])


def test_records_dropped_on_a_full_disk_are_counted_on_metrics(tmp_path: Path) -> None:
    model = make_tiny_model("gemma3", tmp_path / "tiny")
    with small_tmpfs(tmp_path / "facts", "8m") as mount:
        db = mount / "facts.sqlite3"
        with ServerThread(model, f"sqlite:///{db}") as server:
            complete(server.base_url, model.name, PROMPT, 4)
            first = wait_until(
                lambda: (s := scrape(server.base_url)).get("kvrelay_facts_written_total", 0) >= 3 and s,
                30,
                "the first request's facts written",
            )
            assert first['kvrelay_facts_lost_total{reason="dropped"}'] == 0
            filler = fill(mount)
            for _ in range(3):  # routing never waits on the store: every request is served
                assert complete(server.base_url, model.name, PROMPT, 4)["usage"]["completion_tokens"] == 4
            full = wait_until(
                lambda: (s := scrape(server.base_url))['kvrelay_facts_lost_total{reason="dropped"}'] >= 9 and s,
                60,
                "the records of three requests counted as dropped",
            )
            assert full["kvrelay_facts_write_failures_total"] >= 6
            filler.unlink()
            written = full["kvrelay_facts_written_total"]
            complete(server.base_url, model.name, PROMPT, 4)
            wait_until(
                lambda: (
                    (s := scrape(server.base_url))["kvrelay_facts_written_total"] >= written + 3
                    and s["kvrelay_facts_pending"] == 0
                ),
                60,
                "facts written again once the disk has room",
            )
            assert outcome_rows(db) == 2  # the first request and the last; the three between were dropped
