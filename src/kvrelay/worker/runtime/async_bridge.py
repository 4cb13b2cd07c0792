"""Bridge from the device thread's job events to asyncio.

An ``AsyncJobStream`` belongs to one event loop. Its ``on_event`` runs on the
device thread and only schedules ``put_nowait`` on that loop with
``call_soon_threadsafe``, so events arrive in order on the loop. Iterating the
stream yields the job's ``TokenEvent``s and ends after its ``JobResult``;
``await stream.result()`` waits for that result.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from kvrelay.worker.runtime.jobs import JobHandle, JobResult, RuntimeEvent, TokenEvent


class AsyncJobStream:
    """Events of one job delivered on ``loop``; ``handle`` is set by the runtime's ``submit_async``."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._events: asyncio.Queue[RuntimeEvent] = asyncio.Queue()
        self._result: asyncio.Future[JobResult] = loop.create_future()
        self.handle: JobHandle | None = None

    def on_event(self, event: RuntimeEvent) -> None:
        """Device-thread callback: hand ``event`` to the loop without blocking."""
        self._loop.call_soon_threadsafe(self._receive, event)

    def _receive(self, event: RuntimeEvent) -> None:
        self._events.put_nowait(event)
        if isinstance(event, JobResult) and not self._result.done():
            self._result.set_result(event)

    def cancel(self) -> None:
        """Cancel the job (its ``JobResult`` still arrives, once it has quiesced)."""
        assert self.handle is not None
        self.handle.cancel()

    async def result(self) -> JobResult:
        return await asyncio.shield(self._result)

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        while True:
            event = await self._events.get()
            if isinstance(event, JobResult):
                return
            yield event
