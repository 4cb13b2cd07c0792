"""The router's configuration and state (the data the pure ``router.step`` threads through).

The state is threaded linearly: ``step`` updates it and returns it, and the
caller never reuses an older state. It holds no clock, no I/O handle and no
randomness other than the seeded ``rng``.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from kvrelay.core.planning.index import ResidencyIndex
from kvrelay.core.planning.pending import DEFAULT_MAX_PENDING_KEYS, PendingCredits
from kvrelay.core.planning.predicted_ttft import Candidate, WorkerView
from kvrelay.core.planning.registry import Registry
from kvrelay.core.planning.roster import Roster
from kvrelay.core.policies import DEFAULT_POLICY
from kvrelay.core.policies.base import Policy
from kvrelay.core.router.events import Request
from kvrelay.core.router.offered_load import OfferedLoad
from kvrelay.core.router.queue import Limits, RouterQueue
from kvrelay.protocol.chunk_keys import DEFAULT_CHUNK_TOKENS
from kvrelay.protocol.messages import Tier, Usage


@dataclass(frozen=True, slots=True)
class RouterConfig:
    offer_timeout_s: float = 2.0
    """An offer not answered in this time is cancelled and re-routed."""
    progress_timeout_s: float = 30.0
    """An accepted assignment silent for this long (beyond its predicted TTFT) is cancelled and re-routed."""
    worker_expiry_s: float = 3.0
    """A worker whose heartbeats stop for this long is fenced."""
    max_attempts: int = 8
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    max_index_keys: int = 2_000_000
    queue: Limits = field(default_factory=Limits)
    """When requests wait in the router queue and how many may (``router.queue``); ``QUEUE_OFF``: none wait
    for load, only for room."""
    no_worker_wait_s: float = 60.0
    """How long a request some worker took may wait for a server of its model to come back before it fails
    with no_worker (a new request for a model no worker serves fails at once)."""
    predict_on_route: bool = True
    """Let a policy that predicts on route credit pending chunks (``planning.pending``); False: never."""
    pending_timeout_s: float = 30.0
    """A pending credit (``planning.pending``) lasts at most this long beyond twice its predicted TTFT."""
    max_pending_keys: int = DEFAULT_MAX_PENDING_KEYS
    """Bound of the (worker, key) pending credits held at once."""
    model_fingerprints: Mapping[str, bytes] = field(default_factory=dict)
    """Fingerprints to chain keys with; others are learned from heartbeats."""


class Phase(StrEnum):
    """Where a request stands: new -> offered -> running -> done; queued while it waits in the router queue."""

    NEW = "new"
    OFFERED = "offered"
    RUNNING = "running"
    QUEUED = "queued"
    DONE = "done"


@dataclass(slots=True)
class RequestState:
    """One request at the router, across its attempts."""

    request: Request
    arrived: float
    fingerprint: bytes
    attempt: int = 0
    phase: Phase = Phase.NEW
    worker_id: str | None = None
    epoch: int = -1
    candidate: Candidate | None = None
    demand_pages: int = 0
    chain: tuple[bytes, ...] = ()
    """The prompt's chain as the current attempt's offer planned it."""
    gpu_tokens: int = 0
    """Prompt tokens the current attempt's offer took from the worker's device (outside ``demand_pages``)."""
    estimate_s: float = 0.0
    holds_outstanding: bool = False
    accepted_at: int | None = None
    """The worker's heartbeat count when the current attempt's acceptance arrived (``WorkerLoad.accepted``)."""
    holds_inflight: bool = False
    pages_accepted_at: int | None = None
    """The worker's heartbeat count when the current attempt's pages were counted accepted
    (``WorkerLoad.pages_accepted``); None while they are not."""
    delivered: list[int] = field(default_factory=list)
    attempt_start: int = 0
    next_seq: int = 0
    pending: dict[int, tuple[int, ...]] = field(default_factory=dict)
    excluded_workers: set[str] = field(default_factory=set)
    excluded_pairs: set[tuple[str, str]] = field(default_factory=set)
    reasons: list[str] = field(default_factory=list)
    first_token_at: float | None = None
    last_progress: float = 0.0
    queued_since: float | None = None
    cached_tokens: dict[Tier, int] = field(default_factory=dict)
    recomputed_tokens: int = 0
    prompt_tokens: int = 0


@dataclass(slots=True)
class RouterState:
    config: RouterConfig
    policy: Policy
    rng: random.Random
    registry: Registry = field(default_factory=Registry)
    index: ResidencyIndex = field(default_factory=ResidencyIndex)
    pending: PendingCredits = field(init=False)
    """Chunks routed requests are computing, marked in ``index`` (``planning.pending``)."""
    views: dict[str, WorkerView] = field(default_factory=dict)
    """Live workers only."""
    roster: Roster = field(default_factory=Roster)
    """The same views, grouped by cost and ordered by queue (``roster.plan_pruned``)."""
    residency_seq: dict[str, tuple[int, int]] = field(default_factory=dict)
    fingerprints: dict[str, bytes] = field(default_factory=dict)
    requests: dict[str, RequestState] = field(default_factory=dict)
    by_worker: dict[str, set[str]] = field(default_factory=dict)
    queues: dict[str, RouterQueue] = field(default_factory=dict)
    """Requests waiting at the router, one queue per model (``router.queue``); a model's queue never blocks
    another's."""
    offered: dict[str, OfferedLoad] = field(default_factory=dict)
    """Each model's arrival rate of predicted prefill work (``router.offered_load``), which sets the order its
    router queue serves by."""
    wake: bool = False
    """Set when room may have appeared; ``router.step`` then tries the queues' heads again."""
    counters: dict[str, int] = field(default_factory=dict)
    draining: bool = False
    """Set by ``DrainStarted``: new requests end at once with a ``shutting_down`` error."""

    def __post_init__(self) -> None:
        self.pending = PendingCredits(self.index, self.config.max_pending_keys)

    def queued(self) -> int:
        """How many requests wait in the router queues."""
        return sum(len(q) for q in self.queues.values())

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n


def new_router(config: RouterConfig | None = None, policy: Policy | str = DEFAULT_POLICY, seed: int = 0) -> RouterState:
    """A router with no workers and no requests."""
    from kvrelay.core.policies import make_policy

    config = config or RouterConfig()
    return RouterState(
        config=config,
        policy=make_policy(policy) if isinstance(policy, str) else policy,
        rng=random.Random(seed),
        index=ResidencyIndex(config.max_index_keys),
        fingerprints=dict(config.model_fingerprints),
    )


def usage_of(rs: RequestState) -> Usage:
    return Usage(
        prompt_tokens=len(rs.request.prompt),
        cached_tokens=dict(rs.cached_tokens),
        recomputed_tokens=rs.recomputed_tokens,
        generated_tokens=len(rs.delivered),
    )
