"""The status page's routes on the router's HTTP app (read-only; none of them is in the OpenAPI document).

Contract:
- ``add_dashboard(app, router)`` makes a ``ClusterTap``, adds it to the router's
  observers and returns it; the app then serves:
  - ``GET /dashboard``: the page (``static/index.html``; plain HTML, CSS and JS
    shipped in the package, no external asset);
  - ``GET /dashboard/static/{name}``: its script and style sheet;
  - ``GET /dashboard/api/state``: ``snapshot.cluster_state`` (the page polls it);
  - ``GET /dashboard/api/requests/{request_id}``: ``snapshot.request_detail``;
    for a request the tap no longer holds, ``snapshot.stored_detail`` from the
    fact store ``facts`` (read on a thread); a 404 error body naming the request
    when neither has it, or a 503 naming the store when it cannot be read.
- The JSON handlers are ``async``: they run on the router's event loop, between
  its steps, so they read the router and tap state without a lock.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import sqlalchemy as sa
from fastapi import FastAPI
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles

from kvrelay.api.errors import APIError
from kvrelay.dashboard.snapshot import cluster_state, request_detail, stored_detail
from kvrelay.dashboard.tap import ClusterTap
from kvrelay.facts import schema
from kvrelay.facts.queries import FactReader, RequestHistory
from kvrelay.router.cluster_router import ClusterRouter

STATIC = Path(__file__).parent / "static"


def _json(body: object) -> Response:
    return Response(msgspec.json.encode(body), media_type="application/json", headers={"Cache-Control": "no-store"})


def _stored_history(facts: FactReader, request_id: str) -> RequestHistory | None:
    """The request's history in the store; None also before the writer has made the schema (nothing recorded)."""
    try:
        return facts.request_history(request_id)
    except sa.exc.SQLAlchemyError:
        if not sa.inspect(facts.engine).has_table(schema.decisions.name):
            return None
        raise


def add_dashboard(app: FastAPI, router: ClusterRouter, facts: FactReader | None = None) -> ClusterTap:
    """Tap ``router`` and serve the status page on ``app`` (see the module contract)."""
    tap = ClusterTap(lambda: router.state)
    router.observers.append(tap.observe)

    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html", headers={"Cache-Control": "no-store"})

    async def state() -> Response:
        return _json(cluster_state(router.state, tap))

    async def request(request_id: str) -> Response:
        detail = request_detail(tap, request_id)
        if detail is not None:
            return _json(detail)
        history = None
        if facts is not None:
            try:
                history = await asyncio.to_thread(_stored_history, facts, request_id)
            except sa.exc.SQLAlchemyError as exc:
                raise APIError(
                    503,
                    f"request {request_id!r} is not among the last {tap.keep_requests} requests this router saw, "
                    f"and the fact store cannot be read: {exc.__class__.__name__}",
                    "service_unavailable",
                    None,
                    "fact_store_unavailable",
                ) from None
        if history is None:
            raise APIError(
                404,
                f"request {request_id!r} is neither among the last {tap.keep_requests} requests this router saw "
                "nor in its fact store",
                "not_found_error",
                "request_id",
                "request_not_found",
            )
        return _json(stored_detail(history))

    app.add_api_route("/dashboard", page, methods=["GET"], include_in_schema=False)
    app.add_api_route("/dashboard/api/state", state, methods=["GET"], include_in_schema=False)
    app.add_api_route("/dashboard/api/requests/{request_id}", request, methods=["GET"], include_in_schema=False)
    app.mount("/dashboard/static", StaticFiles(directory=STATIC), name="dashboard-static")
    return tap
