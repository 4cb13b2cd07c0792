"""Which request first computed each chunk, so that reuse is counted across requests only.

A retried or continued request may restore chunks that its own abandoned attempt computed (an attempt the router
gave up on keeps computing, and write-through makes its chunks reachable from every worker). The
infinite-cache bounds (``sim.trace``) count reuse across requests, so such self-reuse must not count as a
prefix hit: without this a policy whose requests are often retried scored more than the bound (round robin
on ``configs/cluster-heterogeneous.toml`` at 2x: 229 % of it over the first 300 requests).
"""

from __future__ import annotations

from collections.abc import Iterable


class ChunkOrigins:
    """First computing request per chunk key, and the cached tokens each request found from its own work."""

    def __init__(self, chunk_tokens: int) -> None:
        self.chunk_tokens = chunk_tokens
        self._first: dict[bytes, str] = {}
        self.own_tokens: dict[str, int] = {}
        """Request id -> cached tokens its reported usage counted that its own earlier attempts computed."""

    def computed(self, keys: Iterable[bytes], request_id: str) -> None:
        """``request_id`` computed ``keys``; the first request to compute a key stays its origin."""
        for key in keys:
            self._first.setdefault(key, request_id)

    def reported(self, cached_keys: Iterable[bytes], request_id: str) -> None:
        """A usage of ``request_id`` counted ``cached_keys`` as cached; note those its own attempts computed."""
        own = sum(1 for key in cached_keys if self._first.get(key) == request_id)
        if own:
            self.own_tokens[request_id] = self.own_tokens.get(request_id, 0) + own * self.chunk_tokens
