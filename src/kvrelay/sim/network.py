"""The simulator's seeded network model for control messages.

Each directed link (``src -> dst``, where one end is ``"router"``) delivers a
message after ``delay_s + U[0, jitter_s)`` seconds, loses it with probability
``loss``, and drops it while a directed partition of that link is active
(``start <= send time < end``; ``end = inf`` never heals). Each link is FIFO,
like the WebSocket it models: jitter never lets a message overtake an earlier one
on the same link (it can across links). All draws come from one ``random.Random(seed)``; the simulator calls
``transit`` in a deterministic order, so the same seed gives the same fate to
every message.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from kvrelay.sim.cluster_config import NetworkSpec

ROUTER = "router"


@dataclass(frozen=True, slots=True)
class Partition:
    """Messages sent from ``src`` to ``dst`` during ``[start, end)`` are lost."""

    src: str
    dst: str
    start: float
    end: float = math.inf


class NetworkModel:
    """Message fates on directed links: arrival time, or None when lost."""

    def __init__(self, spec: NetworkSpec, seed: int) -> None:
        self.spec = spec
        self.rng = random.Random(seed)
        self.partitions: list[Partition] = []
        self.link_loss: dict[tuple[str, str], float] = {}
        self.last_arrival: dict[tuple[str, str], float] = {}
        self.sent = 0
        self.lost = 0

    def partition(self, src: str, dst: str, start: float, end: float = math.inf) -> None:
        """Drop ``src -> dst`` messages sent in ``[start, end)``; the reverse direction is untouched."""
        if end <= start:
            raise ValueError(f"partition {src}->{dst} must end after it starts ({start} >= {end})")
        self.partitions.append(Partition(src, dst, start, end))

    def set_loss(self, src: str, dst: str, loss: float) -> None:
        """Override the loss probability of one directed link."""
        if not 0.0 <= loss <= 1.0:
            raise ValueError(f"loss of {src}->{dst} must be in [0, 1], got {loss}")
        self.link_loss[(src, dst)] = loss

    def partitioned(self, src: str, dst: str, now: float) -> bool:
        return any(p.src == src and p.dst == dst and p.start <= now < p.end for p in self.partitions)

    def transit(self, src: str, dst: str, now: float) -> float | None:
        """The arrival time of a message sent now on ``src -> dst``, or None when it is lost.

        Exactly two draws per call keep the stream of draws independent of fates.
        """
        self.sent += 1
        loss_draw = self.rng.random()
        jitter_draw = self.rng.random()
        loss = self.link_loss.get((src, dst), self.spec.loss)
        if loss_draw < loss or (self.partitions and self.partitioned(src, dst, now)):
            self.lost += 1
            return None
        arrival = max(
            now + self.spec.delay_s + jitter_draw * self.spec.jitter_s, self.last_arrival.get((src, dst), 0.0)
        )
        self.last_arrival[(src, dst)] = arrival
        return arrival
