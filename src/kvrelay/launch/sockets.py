"""The listening socket of every HTTP server kvrelay runs (the router, ``kvrelay serve``, the status servers)."""

from __future__ import annotations

import socket


def listen(host: str, port: int, backlog: int = 512) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: any free one), for uvicorn to serve on; its connections
    send small writes at once (``TCP_NODELAY``).

    The protocol number is named (``IPPROTO_TCP``, not 0): asyncio turns Nagle's algorithm off only on the
    transports of sockets whose ``proto`` says TCP (``base_events._set_nodelay``), and an accepted socket
    inherits the listener's. With 0, an SSE stream's first chunk, written just after the response headers,
    waited for the client's ACK of those headers, which a client on a kept-alive connection delays (40 ms on
    Linux): that much on the time to first token (docs/performance.md, "Nagle's algorithm on the first
    chunk")."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    sock.setblocking(False)
    return sock
