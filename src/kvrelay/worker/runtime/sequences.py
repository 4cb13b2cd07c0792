"""What the device loop keeps per job, and what a job must satisfy to be queued.

``RunningSequence`` is one job's state on the device thread (its lane, how many of its input
tokens are written, what it has sampled); ``Row`` is one sequence's share of a forward;
``validate_job(job, kv)`` raises ``ValueError`` naming what is wrong with a job before it is queued.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kvrelay.models.kernels.kv_pages import KVPages
from kvrelay.worker.runtime.iteration import LaneState
from kvrelay.worker.runtime.jobs import Job, JobHandle


@dataclass(slots=True)
class RunningSequence:
    """Device-thread state of one job: ``written`` of its input tokens are in pages, ``fed`` of its samples."""

    handle: JobHandle
    submitted: float
    admitted_at: float | None = None
    first_token_at: float | None = None
    lane: int = -1
    ticket: int = 0
    last_step: int = -1
    written: int = 0
    fed: int = 0
    generated: list[int] = field(default_factory=list)

    @property
    def job(self) -> Job:
        return self.handle.job

    @property
    def prompt_done(self) -> bool:
        """Every input token is written (prefilled or replayed)."""
        return self.written == len(self.job.tokens)

    @property
    def kv_end(self) -> int:
        """One past the last position whose K/V is written (input tokens, then fed-back samples)."""
        return self.job.start_pos + self.written + self.fed

    @property
    def next_position(self) -> int:
        """The absolute position of the next sampled token."""
        return self.job.start_pos + len(self.job.tokens) + len(self.generated)

    def lane_state(self) -> LaneState:
        return LaneState(
            prompt_left=max(0, self.job.prefill_len - self.written),
            admitted=self.ticket,
            last_step=self.last_step,
            place=self.job.place,
        )


class Row(NamedTuple):
    """One sequence's share of a forward: ``tokens`` at positions ``start ..``; ``sample``: draw a token."""

    seq: RunningSequence
    tokens: Sequence[int]
    start: int
    sample: bool


def validate_job(job: Job, kv: KVPages) -> None:
    """Raise ``ValueError`` naming the fault when ``job`` cannot run on ``kv``: no input token, a negative
    position or budget, a replay that leaves nothing to prefill, a page table too short or outside the pool."""
    if not job.tokens:
        raise ValueError("a job needs at least one input token (the prompt, or the last sampled token)")
    if job.start_pos < 0 or job.max_new_tokens < 0:
        raise ValueError(f"start_pos and max_new_tokens must be >= 0; got {job.start_pos}, {job.max_new_tokens}")
    if not 0 <= job.replay < len(job.tokens):
        raise ValueError(
            f"replay must be in 0 .. {len(job.tokens) - 1} (at least one input token is prefilled); got {job.replay}"
        )
    capacity = len(job.page_table) * kv.page_tokens
    if job.positions_needed > capacity:
        raise ValueError(
            f"the job writes positions up to {job.positions_needed - 1} but its page table of "
            f"{len(job.page_table)} pages holds {capacity} tokens; give it "
            f"{-(-job.positions_needed // kv.page_tokens)} pages"
        )
    bad = [p for p in job.page_table if not 0 <= p < kv.num_pages]
    if bad:
        raise ValueError(f"page ids {bad[:5]} are outside the pool of {kv.num_pages} pages")
