"""An embedded kvrelay server (router + worker + HTTP API) on a loopback port, in a background thread."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import uvicorn

from kvrelay.launch.serve import Embedded, ServeOptions, embedded
from kvrelay.launch.worker_assembly import WorkerSettings
from kvrelay.testing.ports import free_port


class ServerThread:
    """``with ServerThread(model_dir) as server: server.base_url ...``; stops and joins on exit."""

    def __init__(self, model_dir: Path, db_url: str) -> None:
        worker = WorkerSettings("local-0", model=str(model_dir), dtype="float32", kv_tokens=8192, lanes=8)
        self.options = ServeOptions(port=free_port(), db_url=db_url, worker=worker)
        self.base_url = f"http://127.0.0.1:{self.options.port}"
        self.ready = threading.Event()
        self.parts: Embedded | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._server: uvicorn.Server | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvrelay-test-server", daemon=True)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # surfaced by __enter__
            self._error = exc
            self.ready.set()

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        async with embedded(self.options) as parts:
            self.parts = parts
            config = uvicorn.Config(parts.app, host="127.0.0.1", port=self.options.port, log_level="warning")
            self._server = uvicorn.Server(config)
            serving = asyncio.ensure_future(self._server.serve())
            while not self._server.started and not serving.done():
                await asyncio.sleep(0.01)
            self.ready.set()
            await serving

    def call(self, fn, *args):  # type: ignore[no-untyped-def]
        """Run ``fn(*args)`` on the server's loop and return its result (for inspecting state safely)."""
        assert self.loop is not None
        future = asyncio.run_coroutine_threadsafe(_call(fn, *args), self.loop)
        return future.result(10)

    def __enter__(self) -> ServerThread:
        self._thread.start()
        if not self.ready.wait(120):
            raise TimeoutError("the test server did not start within 120 s")
        if self._error is not None:
            raise RuntimeError("the test server failed to start") from self._error
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.should_exit = True
        self._thread.join(30)


async def _call(fn, *args):  # type: ignore[no-untyped-def]
    return fn(*args)
