"""The status page's routes on the router stack's app: the page and its assets from the package, read-only JSON,
a request the tap no longer holds read from the fact store, an error body that names an unknown request, and
nothing in the OpenAPI document."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from kvrelay.core.policies import DEFAULT_POLICY
from kvrelay.core.router.events import Record, RecordKind
from kvrelay.core.router.machine import RouterConfig
from kvrelay.facts.explain import explain_lines
from kvrelay.launch.router_stack import build_router_stack
from tests.support.router_driver import heartbeat


def _candidate(worker_id: str, prefill_s: float) -> dict[str, Any]:
    terms = {"queue_s": 0.0, "restore_s": {}, "prefill_s": prefill_s, "decode_s": 0.01}
    return {"worker_id": worker_id, "route": [], "cached_tokens": 0, "predicted_ttft_s": prefill_s, "terms": terms}


def _records(request_id: str) -> list[Record]:
    """One request's decision (w0 chosen over w1), its accepted offer and its outcome, as the router records them."""
    chosen = _candidate("w0", 0.010)
    decision = {"policy": DEFAULT_POLICY, "model": "m", "chosen": chosen, "excluded": {}}
    decision["candidates"] = [chosen, _candidate("w1", 0.015)]
    outcome = {
        "finish_reason": "length",
        "ttft_s": 0.02,
        "inter_token_s": [],
        "cached_tokens": {},
        "recomputed_tokens": 100,
        "generated_tokens": 4,
        "bytes_by_tier": {},
        "attempts": 1,
    }
    return [
        Record(RecordKind.DECISION, request_id, 1, 10.0, decision),
        Record(RecordKind.OFFER_OUTCOME, request_id, 1, 10.1, {"worker_id": "w0", "outcome": "accepted"}),
        Record(RecordKind.OUTCOME, request_id, 1, 10.5, outcome),
    ]


def test_page_assets_state_and_requests_from_the_tap_or_the_store(tmp_path: Path) -> None:
    stack = build_router_stack(
        config=RouterConfig(),
        policy=DEFAULT_POLICY,
        db_url=f"sqlite:///{tmp_path / 'facts.sqlite3'}",
        send=lambda worker_id, message: None,
        models={},
    )
    try:
        stack.router.receive(heartbeat("w0", pages_free=600))
        client = TestClient(stack.app)
        page = client.get("/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert '<script src="/dashboard/static/dashboard.js">' in page.text
        assert "://" not in page.text
        for name, kind in (("dashboard.js", "javascript"), ("dashboard.css", "text/css")):
            asset = client.get("/dashboard/static/" + name)
            assert asset.status_code == 200 and kind in asset.headers["content-type"]
            assert "://" not in asset.text, f"{name} names an external address; the page must work offline"
        state = client.get("/dashboard/api/state").json()
        assert state["policy"] == DEFAULT_POLICY and state["requests"] == [] and state["in_flight"] == 0
        worker = state["workers"]["w0"]
        assert (worker["pages_total"], worker["pages_free"], worker["pages_used"]) == (1000, 600, 400)
        assert worker["heartbeat_age_s"] is not None and worker["heartbeat_age_s"] >= 0
        assert state["hits"]["hit_share"] is None and state["ttft"]["count"] == 0
        assert state["reuse"] == {"available_tokens": 0, "captured_tokens": 0, "delivered_tokens": 0}
        missing = client.get("/dashboard/api/requests/kv-nobody")
        assert missing.status_code == 404
        error = missing.json()["error"]
        assert error["param"] == "request_id" and "nor in its fact store" in error["message"]
        # A request the tap never held (an older one, or another router's) is read from the fact store.
        for record in _records("kv-old"):
            assert stack.facts.submit(record)
        assert stack.facts.flush(30.0)
        old = client.get("/dashboard/api/requests/kv-old").json()
        stored = stack.facts.reader.request_history("kv-old")
        assert stored is not None and old["from_store"] and old["timeline"] == []
        assert old["explain"] == explain_lines(stored) and old["finish_reason"] == "length"
        assert [c["worker_id"] for c in old["decisions"][0]["candidates"]] == ["w0", "w1"]
        assert "predicted TTFT +5.0 ms higher" in old["decisions"][0]["candidates"][1]["lost_because"]
        assert client.get("/dashboard/static/nothing.js").status_code == 404
        paths = client.get("/openapi.json").json()["paths"]
        assert not [p for p in paths if p.startswith("/dashboard")]
    finally:
        asyncio.run(stack.close())
