"""A read-only status listener: a process's live state as JSON, on loopback by default.

``StatusServer(view, host, port)`` answers ``GET /status`` with ``view()``
(JSON-serialisable data) and nothing else; it never changes state. It runs on
the process's event loop, where the state lives, so a view reads a
consistent state without locks. Port 0 picks a free port; ``url`` names the
bound one. It listens on 127.0.0.1 unless told otherwise: what it shows
(every chunk key a process holds) is for the operator of the machine and for
fault tests, not for clients.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from kvrelay.launch import defaults
from kvrelay.launch.sockets import listen

STATUS_PATH = "/status"


class StatusServer:
    """Serves ``view()`` at ``GET /status`` until ``close``."""

    def __init__(self, view: Callable[[], Any], host: str = defaults.STATUS_HOST, port: int = 0) -> None:
        async def status(_: Request) -> JSONResponse:
            return JSONResponse(view())

        app = Starlette(routes=[Route(STATUS_PATH, status, methods=["GET"])])
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self._sock = listen(host, port, backlog=64)
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        host, port = self._sock.getsockname()[:2]
        return f"http://{host}:{port}{STATUS_PATH}"

    async def start(self) -> None:
        """Start serving on the running loop; returns once the listener accepts."""
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[self._sock]))
        while not self._server.started and not self._task.done():
            await asyncio.sleep(0.01)
        if self._task.done():
            self._task.result()

    async def close(self) -> None:
        if self._task is not None:
            self._server.should_exit = True
            await self._task
            self._task = None
        self._sock.close()
