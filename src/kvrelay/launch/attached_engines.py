"""vLLM engines the router drives from its own process (``kvrelay router --vllm-engine URL[,KV_EVENTS]``).

Contract:
- ``attach_engines(settings)`` builds one vLLM worker host per engine (``launch.vllm_worker``: it waits for the
  engine, reads its model and figures) and links each to the router in-process (``transport.local_link``):
  the same host, protocol messages, epochs and fencing as ``kvrelay worker --engine vllm``, without a process
  and a WebSocket hop between the router and each engine. Worker ids are the settings' (``v1``, ``v2``, ...
  from the CLI).
- ``send(fallback)`` is the router's send callback: a message for an attached worker goes to its link, any other
  to ``fallback`` (the WebSocket endpoint, where remote workers of the same cluster connect).
- ``start(sink)`` links every host to ``sink`` (the router, or the catalog's tap in front of it) and starts
  its heartbeats, ``/metrics`` polls and KV event subscription; ``close()`` stops them and closes the clients.

One process to deploy, as a peer router is, without a WebSocket hop between the router and an engine; but
the hosts' work then shares the router's event loop, and on the 2-core development machine a worker process
per engine was faster (docs/design.md section 13).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvrelay.launch.vllm_worker import VllmParts, VllmSettings, build_vllm_worker
from kvrelay.protocol.messages import WireMessage
from kvrelay.transport.local_link import LocalLink, Sink

Send = Callable[[str, WireMessage], None]


@dataclass
class AttachedEngines:
    """The attached engines' parts and, once started, their links (see the module contract)."""

    parts: list[VllmParts]
    heartbeat_s: float
    links: dict[str, LocalLink] = field(default_factory=dict)

    @property
    def model_dirs(self) -> tuple[Path, ...]:
        """The directories the engines serve, each once, in the order given."""
        return tuple(dict.fromkeys(p.model_dir for p in self.parts))

    def send(self, fallback: Send) -> Send:
        def send(worker_id: str, message: WireMessage) -> None:
            link = self.links.get(worker_id)
            if link is None:
                fallback(worker_id, message)
            else:
                link.deliver(message)

        return send

    def start(self, sink: Sink) -> None:
        for part in self.parts:
            link = LocalLink(part.controller, sink, self.heartbeat_s)
            self.links[link.worker_id] = link
            part.start()
            link.start()

    async def close(self) -> None:
        """Stop the links, then the hosts' tasks and clients; a second call does nothing."""
        links, parts = list(self.links.values()), list(self.parts)
        self.links.clear()
        self.parts.clear()
        for link in links:
            await link.close()
        for part in parts:
            await part.aclose()


async def attach_engines(settings: Sequence[VllmSettings], heartbeat_s: float) -> AttachedEngines:
    """One vLLM worker host per engine, built concurrently; on a failure the ones built are closed."""
    ids = [s.worker_id for s in settings]
    if len(set(ids)) != len(ids):
        raise ValueError(f"attached engines need distinct worker ids; got {', '.join(ids)}")
    built = await asyncio.gather(*(build_vllm_worker(s) for s in settings), return_exceptions=True)
    parts = [b for b in built if isinstance(b, VllmParts)]
    for failure in built:
        if isinstance(failure, BaseException):
            await asyncio.gather(*(p.aclose() for p in parts), return_exceptions=True)
            raise failure
    return AttachedEngines(parts, heartbeat_s)
