"""The simulated consumers: what each request's client received, and what every delivery must satisfy.

Checked independently of the router: deltas are gapless and duplicate-free, equal the deterministic
token values (``sim.tokens``), and come from the request's current attempt (the last one offered and
not cancelled); each request gets exactly one outcome, whose tokens are the delivered stream. The
``receive_*`` functions record a delivery and return the rules it broke, as readable lines.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvrelay.core.router.events import DeliverDelta, Outcome
from kvrelay.protocol.messages import Assignment
from kvrelay.sim.tokens import token_value


@dataclass(slots=True)
class SimConsumer:
    """What one request's consumer received (the request itself is not kept)."""

    request_id: str
    submitted_at: float
    prompt_tokens: int = 0
    seed: int = 0
    stream: list[int] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
    first_token_at: float | None = None


def receive_delta(
    consumer: SimConsumer, delta: DeliverDelta, cause: Assignment | None, live: bool, now: float
) -> list[str]:
    """Append ``delta`` to the stream (``now``: its first token's time if none came before); ``live``: ``cause``
    is the request's current attempt."""
    rid = delta.request_id
    broken = []
    if not live:
        broken.append(f"{rid}: tokens at {delta.index} delivered from stale or no attempt {cause}")
    if delta.index != len(consumer.stream):
        broken.append(f"{rid}: delta at index {delta.index}, stream has {len(consumer.stream)} tokens")
    base = consumer.prompt_tokens + delta.index
    if list(delta.tokens) != [token_value(consumer.seed, base + i) for i in range(len(delta.tokens))]:
        broken.append(f"{rid}: tokens at {delta.index} differ from the deterministic values")
    if consumer.first_token_at is None and delta.tokens:
        consumer.first_token_at = now
    consumer.stream.extend(delta.tokens)
    return broken


def receive_outcome(consumer: SimConsumer, outcome: Outcome) -> list[str]:
    """Record ``outcome``; a second outcome, or tokens other than the delivered stream, break the rules."""
    consumer.outcomes.append(outcome)
    broken = []
    if len(consumer.outcomes) > 1:
        broken.append(f"{outcome.request_id}: outcome number {len(consumer.outcomes)}")
    if list(outcome.tokens) != consumer.stream:
        broken.append(f"{outcome.request_id}: outcome tokens differ from the delivered stream")
    return broken
