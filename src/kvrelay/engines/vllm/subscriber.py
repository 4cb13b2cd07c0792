"""The ZMQ subscriber of a vLLM engine's KV events (the effectful side of ``kv_events``).

``follow_kv_events(url, on_frame, on_reconnect)`` connects a SUB socket to
``url`` (vLLM binds ``tcp://*:PORT``; the subscriber connects to
``tcp://HOST:PORT``), subscribes to every topic and calls ``on_frame(parts)``
for each multipart frame, on the running loop, until cancelled. ZMQ
reconnects by itself; a socket monitor reports each reconnection after a
disconnection as ``on_reconnect()``, because events published while the link
was down are lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger(__name__)


async def follow_kv_events(url: str, on_frame: Callable[[list[bytes]], None], on_reconnect: Callable[[], None]) -> None:
    """Deliver ``url``'s frames to ``on_frame`` until cancelled (see the module docstring)."""
    context = zmq.asyncio.Context.instance()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.setsockopt(zmq.RECONNECT_IVL, 100)
    socket.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    monitor = socket.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    socket.connect(url)
    watcher = asyncio.get_running_loop().create_task(_watch(monitor, url, on_reconnect))
    try:
        while True:
            on_frame(await socket.recv_multipart())
    finally:
        watcher.cancel()
        socket.disable_monitor()
        monitor.close(linger=0)
        socket.close(linger=0)


async def _watch(monitor: zmq.asyncio.Socket, url: str, on_reconnect: Callable[[], None]) -> None:
    lost = False
    while True:
        message = await recv_monitor_message(monitor)
        event = message["event"]
        if event == zmq.EVENT_DISCONNECTED:
            lost = True
            log.info("KV event stream %s disconnected", url)
        elif event == zmq.EVENT_CONNECTED and lost:
            lost = False
            log.info("KV event stream %s reconnected", url)
            on_reconnect()
