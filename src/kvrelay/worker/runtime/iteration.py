"""The pure per-iteration policy of the paged runtime (docs/design.md section 8).

``plan_iteration(config, lanes, waiting)`` decides what ONE model forward does:

- Decode first: every decoding lane gets one token row, oldest-served first. When
  the worker has several lanes and prefill work is waiting (a lane still writing its
  prompt, or a waiting job that a free lane could admit), decode takes at most
  ``token_budget - 1`` rows, keeping one lane-token for that prefill work.
- A single-lane worker finishes its decode before it admits another prompt.
- Lanes are stable physical slots: a sequence keeps the lane it was admitted to until
  it finishes; a waiting job gets the lowest free lane.
- Prefill is chunked under the token budget; a forward with no decoding lane may take
  ``prefill_only_budget`` instead (larger: no decode step waits behind it, and a cold prompt
  runs in fewer, larger forwards). Lanes already prefilling continue by
  their jobs' place (``Job.place``), then in admission order; waiting jobs are
  admitted in queue order (never skipping the head) while a lane and budget remain,
  after the prefilling lanes, except that one whose place is lower than a prefilling
  lane's goes before it; each takes ``min(prompt_left, budget_left)`` tokens.
- A chunk that does not finish its prompt joins a forward that already carries prompt tokens
  (every one of which finishes its prompt: an unfinished chunk takes the rest of the budget) only
  if it is no larger than they are: it would otherwise more than double the wait for the first
  tokens that forward gives (a follower joining after its leader's prefill waited out a 512-token
  chunk of a longer prompt); the longer prompt pays one more forward's fixed cost instead. Never
  dropping it, or always, cost first tokens or throughput (docs/performance.md, "A follower's
  first token").

Follows the shape of vLLM's and nano-vllm's chunked-prefill schedulers (decode
first, prefill fills the remaining token budget) but keeps lane slots fixed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """``num_lanes`` concurrent sequences; at most ``token_budget`` tokens per forward, or
    ``prefill_only_budget`` in a forward with no decoding lane (0: ``token_budget``)."""

    num_lanes: int
    token_budget: int
    prefill_only_budget: int = 0

    def __post_init__(self) -> None:
        if self.num_lanes < 1:
            raise ValueError(f"num_lanes must be at least 1, got {self.num_lanes}")
        least = 1 if self.num_lanes == 1 else 2
        if self.token_budget < least:
            raise ValueError(
                f"token_budget must be at least {least} with {self.num_lanes} lane(s) "
                f"(several lanes keep one lane-token for prefill), got {self.token_budget}"
            )
        if self.prefill_only_budget and self.prefill_only_budget < self.token_budget:
            raise ValueError(
                f"prefill_only_budget must be 0 or at least token_budget ({self.token_budget}), "
                f"got {self.prefill_only_budget}"
            )

    def budget(self, decoding: int) -> int:
        """Tokens a forward with ``decoding`` decoding lanes may take."""
        if decoding == 0 and self.prefill_only_budget:
            return self.prefill_only_budget
        return self.token_budget


@dataclass(frozen=True, slots=True)
class LaneState:
    """The sequence in one lane.

    ``prompt_left`` tokens of its input are not yet written (0: it is decoding);
    ``admitted`` orders lanes by admission (smaller is older); ``last_step`` is the
    iteration that last gave it a row (decode fairness when the budget is short);
    prefilling lanes continue by ``place`` (``Job.place``), then admission.
    """

    prompt_left: int
    admitted: int
    last_step: int = -1
    place: float = 0.0

    @property
    def decoding(self) -> bool:
        return self.prompt_left == 0


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """Write the next ``tokens`` prompt tokens of the sequence in ``lane``."""

    lane: int
    tokens: int


@dataclass(frozen=True, slots=True)
class IterationPlan:
    """One forward: ``decode_lanes`` (ascending) get one row each; ``prefill`` chunks follow.

    ``admit[i]`` is the lane given to the i-th waiting job (the first ``len(admit)``
    waiting jobs are admitted); their first chunks are already in ``prefill``.
    """

    decode_lanes: tuple[int, ...]
    prefill: tuple[PrefillChunk, ...]
    admit: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return len(self.decode_lanes) + sum(c.tokens for c in self.prefill)

    @property
    def idle(self) -> bool:
        return self.num_tokens == 0


def plan_iteration(
    config: PolicyConfig,
    lanes: Sequence[LaneState | None],
    waiting: Sequence[int],
    waiting_places: Sequence[float] = (),
) -> IterationPlan:
    """Plan one iteration.

    ``lanes[i]`` is lane i's sequence or ``None`` (free); ``len(lanes) == config.num_lanes``.
    ``waiting`` lists the input lengths (each >= 1) of queued jobs in queue order (``prefill_order``),
    ``waiting_places`` their places (``Job.place``; empty: all 0). A waiting job whose place is lower than a
    prefilling lane's is admitted before that lane continues (never past the queue's head).
    The plan never exceeds ``config.budget(decoding)`` tokens and never gives a lane two roles.
    """
    if len(lanes) != config.num_lanes:
        raise ValueError(f"expected {config.num_lanes} lanes, got {len(lanes)}")
    if any(n < 1 for n in waiting):
        raise ValueError("every waiting job must have at least one input token")
    places = list(waiting_places) if waiting_places else [0.0] * len(waiting)
    if len(places) != len(waiting):
        raise ValueError(f"expected {len(waiting)} waiting places, got {len(places)}")
    free_lanes = [i for i, lane in enumerate(lanes) if lane is None]
    decoding = [i for i, lane in enumerate(lanes) if lane is not None and lane.decoding]
    prefilling = sorted(
        (i for i, lane in enumerate(lanes) if lane is not None and not lane.decoding),
        key=lambda i: (lanes[i].place, lanes[i].admitted),  # type: ignore[union-attr]
    )
    single_lane_busy = config.num_lanes == 1 and bool(decoding)
    admissible = bool(waiting) and bool(free_lanes) and not single_lane_busy
    prefill_waiting = bool(prefilling) or admissible

    decode_cap = config.token_budget
    if config.num_lanes > 1 and prefill_waiting:
        decode_cap = config.token_budget - 1
    if len(decoding) > decode_cap:
        by_age = sorted(decoding, key=lambda i: (lanes[i].last_step, i))  # type: ignore[union-attr]
        decoding = sorted(by_age[:decode_cap])
    budget = config.budget(len(decoding)) - len(decoding)

    chunks: list[PrefillChunk] = []
    admit: list[int] = []
    admissible_jobs = min(len(waiting), len(free_lanes)) if admissible else 0
    p = w = 0
    carried = 0
    while budget > 0 and (p < len(prefilling) or w < admissible_jobs):
        lane_place = lanes[prefilling[p]].place if p < len(prefilling) else math.inf  # type: ignore[union-attr]
        admits = w < admissible_jobs and places[w] < lane_place
        left = waiting[w] if admits else lanes[prefilling[p]].prompt_left  # type: ignore[union-attr]
        take = min(left, budget)
        if take < left and 0 < carried < take:
            break  # an unfinished chunk would more than double the wait for the first tokens this forward gives
        if admits:
            lane = free_lanes[w]
            admit.append(lane)
            w += 1
        else:
            lane = prefilling[p]
            p += 1
        chunks.append(PrefillChunk(lane, take))
        budget -= take
        carried += take
    return IterationPlan(tuple(decoding), tuple(chunks), tuple(admit))
