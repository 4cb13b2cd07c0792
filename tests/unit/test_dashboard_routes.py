"""The status page's routes on the router stack's app: the page and its assets from the package, read-only JSON,
an error body that names an unknown request and the command that reads it, and nothing in the OpenAPI document."""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi.testclient import TestClient

from kvrelay.core.policies import DEFAULT_POLICY
from kvrelay.core.router.machine import RouterConfig
from kvrelay.launch.router_stack import build_router_stack
from tests.support.router_driver import heartbeat


def test_page_assets_state_and_unknown_request(tmp_path: Path) -> None:
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
        assert error["param"] == "request_id" and "kvrelay explain kv-nobody" in error["message"]
        assert client.get("/dashboard/static/nothing.js").status_code == 404
        paths = client.get("/openapi.json").json()["paths"]
        assert not [p for p in paths if p.startswith("/dashboard")]
    finally:
        asyncio.run(stack.close())
