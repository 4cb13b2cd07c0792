"""The status page's routes on the router's HTTP app (read-only; none of them is in the OpenAPI document).

Contract:
- ``add_dashboard(app, router)`` makes a ``ClusterTap``, adds it to the router's
  observers and returns it; the app then serves:
  - ``GET /dashboard``: the page (``static/index.html``; plain HTML, CSS and JS
    shipped in the package, no external asset);
  - ``GET /dashboard/static/{name}``: its script and style sheet;
  - ``GET /dashboard/api/state``: ``snapshot.cluster_state`` (the page polls it);
  - ``GET /dashboard/api/requests/{request_id}``: ``snapshot.request_detail``, or
    a 404 error body naming the request and ``kvrelay explain`` when the tap no
    longer holds it.
- The JSON handlers are ``async``: they run on the router's event loop, between
  its steps, so they read the router and tap state without a lock.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
from fastapi import FastAPI
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles

from kvrelay.api.errors import APIError
from kvrelay.dashboard.snapshot import cluster_state, request_detail
from kvrelay.dashboard.tap import ClusterTap
from kvrelay.router.cluster_router import ClusterRouter

STATIC = Path(__file__).parent / "static"


def _json(body: object) -> Response:
    return Response(msgspec.json.encode(body), media_type="application/json", headers={"Cache-Control": "no-store"})


def add_dashboard(app: FastAPI, router: ClusterRouter) -> ClusterTap:
    """Tap ``router`` and serve the status page on ``app`` (see the module contract)."""
    tap = ClusterTap(lambda: router.state)
    router.observers.append(tap.observe)

    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html", headers={"Cache-Control": "no-store"})

    async def state() -> Response:
        return _json(cluster_state(router.state, tap))

    async def request(request_id: str) -> Response:
        detail = request_detail(tap, request_id)
        if detail is None:
            raise APIError(
                404,
                f"request {request_id!r} is not among the last {tap.keep_requests} requests this router saw; "
                f"`kvrelay explain {request_id}` reads its decisions from the fact store",
                "not_found_error",
                "request_id",
                "request_not_found",
            )
        return _json(detail)

    app.add_api_route("/dashboard", page, methods=["GET"], include_in_schema=False)
    app.add_api_route("/dashboard/api/state", state, methods=["GET"], include_in_schema=False)
    app.add_api_route("/dashboard/api/requests/{request_id}", request, methods=["GET"], include_in_schema=False)
    app.mount("/dashboard/static", StaticFiles(directory=STATIC), name="dashboard-static")
    return tap
