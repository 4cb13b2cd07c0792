"""Shared pieces of the simulator scenarios: a small cluster, prompts, and the invariant check."""

from __future__ import annotations

import zlib
from dataclasses import replace

from kvrelay.core.router.events import Request
from kvrelay.protocol.messages import Sampling
from kvrelay.sim.cluster_config import ClusterConfig, NetworkSpec, WorkerSpec
from kvrelay.sim.interpreter import Simulation
from kvrelay.sim.tokens import token_value

MODEL = "llama-3-8b"


def small_cluster(
    workers: int = 2, gpu_kv_tokens: int = 65536, object_tier: bool = False, loss: float = 0.0
) -> ClusterConfig:
    """Two workers with the default declared costs (0.1 ms/token prefill, 25 ms decode steps)."""
    spec = replace(
        WorkerSpec(),
        gpu_kv_tokens=gpu_kv_tokens,
        ram_kv_tokens=4 * gpu_kv_tokens,
        ssd_kv_tokens=16 * gpu_kv_tokens,
        max_lanes=8,
        context_limit=100_000,
    )
    return ClusterConfig(
        workers=workers,
        model=MODEL,
        object_write_through=object_tier,
        worker=spec,
        network=NetworkSpec(delay_s=0.0005, jitter_s=0.0002, loss=loss),
    )


def tokens(stream_id: int, n: int) -> tuple[int, ...]:
    """``n`` deterministic prompt tokens, distinct per ``stream_id``."""
    return tuple((stream_id * 7919 + i * 31) % 30000 + 1 for i in range(n))


def request(rid: str, prompt: tuple[int, ...], max_new: int, seed: int | None = None) -> Request:
    return Request(rid, MODEL, prompt, max_new, Sampling(seed=zlib.crc32(rid.encode()) if seed is None else seed))


def expected_stream(sim: Simulation, rid: str, n: int) -> list[int]:
    """The deterministic tokens the consumer of ``rid`` must see, ``n`` of them."""
    c = sim.consumers[rid]
    return [token_value(c.seed, c.prompt_tokens + i) for i in range(n)]


def offers_of(sim: Simulation, rid: str) -> list:
    return [o for o in sim.offers if o.assignment.request_id == rid]


def assert_invariants(sim: Simulation) -> None:
    """Exactly one outcome per request, no consumer-side violation, no reservation left."""
    assert sim.violations == []
    for rid, c in sim.consumers.items():
        assert len(c.outcomes) == 1, f"{rid}: {len(c.outcomes)} outcomes"
        assert list(c.outcomes[0].tokens) == c.stream
    for wid, w in sim.workers.items():
        assert not w.holds_reservations(), f"{wid} still holds a reservation"
        assert w.caches.gpu.reserved == 0 and w.caches.gpu.pinned_chunks == 0
