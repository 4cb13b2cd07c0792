"""``launch.sockets.listen``: the socket kvrelay's HTTP servers (router, serve, status) listen on."""

from __future__ import annotations

import asyncio
import socket

from kvrelay.launch.sockets import listen


async def _accepted_nodelay(sock: socket.socket) -> int:
    """TCP_NODELAY of the server side of one connection accepted through asyncio, as uvicorn accepts them."""
    accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def handle(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(handle, sock=sock)
    host, port = server.sockets[0].getsockname()[:2]
    _, client = await asyncio.open_connection(host, port)
    try:
        return await asyncio.wait_for(accepted, 10)
    finally:
        client.close()
        server.close()
        await server.wait_closed()


def test_connections_accepted_on_a_listen_socket_send_small_writes_at_once() -> None:
    # Nagle's algorithm on would hold an SSE stream's first chunk until the client acknowledges the headers.
    assert asyncio.run(_accepted_nodelay(listen("127.0.0.1", 0))) != 0


def test_the_check_tells_a_socket_asyncio_leaves_nagle_on() -> None:
    bare = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # protocol 0: asyncio does not set TCP_NODELAY
    bare.bind(("127.0.0.1", 0))
    bare.listen(8)
    bare.setblocking(False)
    assert asyncio.run(_accepted_nodelay(bare)) == 0
