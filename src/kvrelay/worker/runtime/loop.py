"""The device-owning loop of a worker (docs/design.md section 8).

``PagedRuntime(model, kv, policy, queue_capacity)`` starts one thread that alone
runs the model. Callers on any thread ``submit`` jobs (see ``jobs``) into a
bounded queue; asyncio callers use ``submit_async`` and iterate an
``AsyncJobStream``. Each iteration:

1. finishes cancelled jobs (the previous step has completed, so this is their
   quiescence point) and frees their lanes;
2. asks the pure ``plan_iteration`` policy for decode rows and prefill chunks;
3. runs ONE forward over that mixed batch and samples the rows that need a token;
4. emits token events and terminal results.

Backpressure: the queue bound counts jobs waiting for a lane. ``submit`` blocks
while the queue is full and raises ``QueueFullError`` after ``timeout`` seconds
(``timeout=0``: fail at once); ``submit_async`` waits the same way without
blocking the event loop. A forward that raises fails only the jobs in that batch
(``finish_reason="error"``); the loop keeps serving.

Threads: the device thread owns torch's intra-op pool; the thread that constructs
the runtime and every other thread run torch ops serially (``torch_threads``); heavy
torch work runs on the device thread through ``run_on_device``. The process's C heap
keeps what a forward frees for the next one (``heap_reuse``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from typing import Any, Protocol, TypeVar

import torch

from kvrelay.core.planning.prefill_order import queue_position
from kvrelay.core.worker.speeds import DeviceSpeeds, learn
from kvrelay.models.batch import ForwardBatch, LaneRef
from kvrelay.models.kernels.kv_pages import KVPages
from kvrelay.models.sampling import sample_next
from kvrelay.protocol.messages import FinishReason
from kvrelay.worker.runtime.async_bridge import AsyncJobStream
from kvrelay.worker.runtime.heap_reuse import keep_freed_memory
from kvrelay.worker.runtime.iteration import PolicyConfig, plan_iteration
from kvrelay.worker.runtime.jobs import (
    EventCallback,
    Job,
    JobHandle,
    JobResult,
    QueueFullError,
    RuntimeClosedError,
    TokenEvent,
)
from kvrelay.worker.runtime.sequences import Row, RunningSequence, validate_job
from kvrelay.worker.runtime.torch_threads import confine_threads, name_os_thread, own_pool

T = TypeVar("T")

FOLLOWER_WAIT_S = 0.05
"""The longest the device thread waits, after a job's first token, for the jobs that share its prompt
(``JobHandle.expect_followers``): a few host-loop turns; a forward of the next prefill's chunk takes longer."""

log = logging.getLogger(__name__)


def _cancel_when_queued(submitted: asyncio.Future[JobHandle]) -> None:
    """Cancel the job of ``submitted`` once it is queued, when its caller gave up before that."""
    if not submitted.cancelled() and submitted.exception() is None:
        submitted.result().cancel()


class StepModel(Protocol):
    """What the runtime needs of a model: one step over a batch, writing its K/V into ``kv`` and giving
    the rows that want a token (``hidden``), then those rows' logits or greedy tokens.

    The runtime takes logits in the model's own dtype: sampling reads bfloat16 logits as
    they are, sparing a float32 copy of ``[rows, vocab]`` per step. ``greedy(h)`` must equal
    ``greedy_tokens(logits(h))``.
    """

    def hidden(self, batch: ForwardBatch, kv: KVPages) -> torch.Tensor: ...

    def logits(self, h: torch.Tensor) -> torch.Tensor: ...

    def greedy(self, h: torch.Tensor) -> list[int]: ...


class PagedRuntime:
    """One device thread running continuously batched jobs over one paged KV pool."""

    def __init__(
        self,
        model: StepModel,
        kv: KVPages,
        policy: PolicyConfig,
        queue_capacity: int = 64,
        name: str = "kvrelay-device",
        threads: int | None = None,
    ) -> None:
        """``threads``: the device thread's torch pool (default: the process's, see ``torch_threads``)."""
        if queue_capacity < 1:
            raise ValueError(f"queue_capacity must be at least 1, got {queue_capacity}")
        self.model = model
        self.kv = kv
        self.policy = policy
        self.queue_capacity = queue_capacity
        self._cond = threading.Condition()
        self._waiting: deque[RunningSequence] = deque()
        self._lanes: list[RunningSequence | None] = [None] * policy.num_lanes
        self._closing = False
        self._ids = itertools.count(1)
        self._tickets = itertools.count()
        self._step = 0
        self.speeds = DeviceSpeeds()
        """What a forward costs now, learned from every forward (``core.worker.speeds``); written by the device
        thread only, read by any (one attribute, replaced whole)."""
        self._calls: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._held: list[JobHandle] = []
        """Jobs whose first token was just sampled and whose followers the next plan waits for (device thread)."""
        pool = confine_threads()
        keep_freed_memory()
        self.threads = pool if threads is None else threads
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- caller side (any thread) ----

    def submit(self, job: Job, on_event: EventCallback | None = None, timeout: float | None = None) -> JobHandle:
        """Queue ``job`` at its priority's place (``prefill_order``), equal priorities by ``Job.place`` (a job
        resubmitted after waiting for a shared prefix keeps its turn), then submission; block while the queue
        is full, raising ``QueueFullError`` after ``timeout`` s."""
        validate_job(job, self.kv)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while len(self._waiting) >= self.queue_capacity and not self._closing:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise QueueFullError(
                        f"the runtime queue is full ({self.queue_capacity} jobs waiting for a lane); "
                        "retry later or raise queue_capacity"
                    )
                self._cond.wait(left)
            if self._closing:
                raise RuntimeClosedError("the runtime is closed; it accepts no more jobs")
            handle = JobHandle(next(self._ids), job, on_event, self._wake)
            keys = [(w.handle.job.priority, w.handle.job.place) for w in self._waiting]
            at = queue_position(keys, 0, (job.priority, job.place))
            self._waiting.insert(at, RunningSequence(handle, submitted=time.perf_counter()))
            self._cond.notify_all()
        return handle

    async def submit_async(self, job: Job, timeout: float | None = None) -> AsyncJobStream:
        """``submit`` for asyncio callers: events arrive on the running loop via ``call_soon_threadsafe``."""
        stream = AsyncJobStream(asyncio.get_running_loop())
        try:
            stream.handle = self.submit(job, stream.on_event, timeout=0)
        except QueueFullError:
            if timeout == 0:
                raise
            pending = asyncio.get_running_loop().run_in_executor(None, self.submit, job, stream.on_event, timeout)
            try:
                stream.handle = await asyncio.shield(pending)
            except asyncio.CancelledError:  # the caller gave up: cancel the job if it gets queued after all
                pending.add_done_callback(_cancel_when_queued)
                raise
        return stream

    def run_on_device(self, fn: Callable[[], T], timeout: float | None = None) -> T:
        """Run ``fn`` on the device thread between two iterations; return its result or raise its error.

        For heavy torch work beside the runtime (a baseline model, a bulk copy): there it uses
        the runtime's torch pool instead of opening a second one (``torch_threads``). ``fn``
        runs outside the loop's inference mode.
        """
        future: Future[T] = Future()
        with self._cond:
            if self._closing:
                raise RuntimeClosedError("the runtime is closed; it runs nothing more")
            self._calls.append((fn, future))
            self._cond.notify_all()
        return future.result(timeout)

    def generate(self, job: Job, timeout: float | None = None) -> JobResult:
        """Submit ``job`` and wait for its result (convenience for scripts and tests)."""
        return self.submit(job).result(timeout)

    @property
    def num_active(self) -> int:
        return sum(lane is not None for lane in self._lanes)

    @property
    def num_decoding(self) -> int:
        """Lanes whose prompt is written: each takes a row of every forward."""
        return sum(lane is not None and lane.prompt_done for lane in list(self._lanes))

    def close(self, timeout: float | None = 30.0) -> None:
        """Stop accepting jobs, cancel every job (each gets its ``JobResult``), join the device thread."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the device thread did not stop within {timeout} s")

    def __enter__(self) -> PagedRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # ---- device thread ----

    def _run(self) -> None:
        name_os_thread(self._thread.name)  # before the first parallel region: the team takes this name
        own_pool(self.threads)
        with torch.inference_mode():
            while True:
                self._await_followers()
                with self._cond:
                    while not self._closing and not self._waiting and not self._calls and self.num_active == 0:
                        self._cond.wait()
                    if self._closing:
                        break
                    calls = list(self._calls)
                    self._calls.clear()
                    cancelled = [s for s in self._waiting if s.handle.cancel_requested]
                    for seq in cancelled:
                        self._waiting.remove(seq)
                    waiting = list(itertools.islice(self._waiting, self.policy.num_lanes))
                    if cancelled:
                        self._cond.notify_all()
                for fn, future in calls:
                    _call(fn, future)
                for seq in cancelled:
                    self._finish(seq, FinishReason.CANCELLED)
                for lane_seq in self._lanes:
                    if lane_seq is not None and lane_seq.handle.cancel_requested:
                        self._finish(lane_seq, FinishReason.CANCELLED)
                self._iterate(waiting)
        self._shutdown()

    def _await_followers(self) -> None:
        """Wait, at most ``FOLLOWER_WAIT_S`` in all, for the followers of the jobs whose first token came last step."""
        if not self._held:
            return
        deadline = time.monotonic() + FOLLOWER_WAIT_S
        for handle in self._held:
            handle.wait_followers(max(0.0, deadline - time.monotonic()))
        self._held.clear()

    def _iterate(self, waiting: list[RunningSequence]) -> None:
        lanes = [None if s is None else s.lane_state() for s in self._lanes]
        plan = plan_iteration(self.policy, lanes, [s.job.prefill_len for s in waiting], [s.job.place for s in waiting])
        if plan.admit:
            admitted_ids = {id(seq) for seq in waiting[: len(plan.admit)]}
            with self._cond:  # by identity: a job submitted since the snapshot may now stand before them
                self._waiting = deque(seq for seq in self._waiting if id(seq) not in admitted_ids)
                self._cond.notify_all()
            now = time.perf_counter()
            for admitted, lane in zip(waiting, plan.admit):
                admitted.lane, admitted.ticket, admitted.admitted_at = lane, next(self._tickets), now
                self._lanes[lane] = admitted
        if plan.idle:
            return
        rows: list[Row] = []
        for lane in plan.decode_lanes:
            seq = self._lanes[lane]
            assert seq is not None
            if seq.prompt_done:
                rows.append(Row(seq, seq.generated[-1:], seq.kv_end, True))
            else:  # a replayed input token: a decode row that samples only after the last one
                last = seq.written + 1 == len(seq.job.tokens)
                token = seq.job.tokens[seq.written : seq.written + 1]
                rows.append(Row(seq, token, seq.kv_end, last and seq.job.max_new_tokens > 0))
        for chunk in plan.prefill:
            seq = self._lanes[chunk.lane]
            assert seq is not None
            tokens = seq.job.tokens[seq.written : seq.written + chunk.tokens]
            completes = seq.written + chunk.tokens == len(seq.job.tokens)  # never, while tokens are to replay
            rows.append(Row(seq, tokens, seq.job.start_pos + seq.written, completes and seq.job.max_new_tokens > 0))
        self._step += 1
        prefill_tokens = sum(len(r.tokens) for r in rows[len(plan.decode_lanes) :])
        started = time.perf_counter()
        try:
            sampled = self._forward(rows)
        except Exception as exc:  # a bad batch fails its jobs, not the worker
            log.exception("forward failed; failing the %d jobs of this batch", len(rows))
            for row in rows:
                self._finish(row.seq, FinishReason.ERROR, error=f"{type(exc).__name__}: {exc}")
            return
        self.speeds = learn(self.speeds, prefill_tokens, time.perf_counter() - started, time.monotonic())
        for row in rows:
            row.seq.last_step = self._step
            if row.seq.prompt_done:
                row.seq.fed += 1
            else:
                row.seq.written += len(row.tokens)
                row.seq.handle.written = row.seq.written
        sampled_iter = iter(sampled)
        for row in rows:
            if row.sample:
                self._accept_token(row.seq, next(sampled_iter))
            elif row.seq.prompt_done and row.seq.job.max_new_tokens == 0:
                self._finish(row.seq, FinishReason.LENGTH)

    def _forward(self, rows: list[Row]) -> list[int]:
        """Run one forward over ``rows`` and sample the rows that want a token, in row order."""
        batch = ForwardBatch.build(
            [(r.tokens, r.start, r.seq.job.page_table) for r in rows],
            device=self.kv.device,
            lanes=[LaneRef(r.seq.lane, r.seq.handle.job_id) for r in rows],
        )
        wanted = [i for i, row in enumerate(rows) if row.sample]
        if len(wanted) != len(rows):
            batch = replace(batch, logits_indices=batch.logits_indices[wanted])
        h = self.model.hidden(batch, self.kv)
        if not wanted:
            return []
        seqs = [rows[i].seq for i in wanted]
        params = [s.job.sampling for s in seqs]
        if all(p.temperature == 0.0 for p in params):
            return self.model.greedy(h)
        return sample_next(self.model.logits(h), params, [s.next_position for s in seqs])

    def _accept_token(self, seq: RunningSequence, token: int) -> None:
        if seq.handle.cancel_requested:
            self._finish(seq, FinishReason.CANCELLED)
            return
        position = seq.next_position
        seq.generated.append(token)
        if seq.first_token_at is None:
            seq.first_token_at = time.perf_counter()
            if seq.handle.expects_followers:
                self._held.append(seq.handle)
        seq.handle.deliver(TokenEvent(seq.handle.job_id, len(seq.generated) - 1, token, position))
        if token in seq.job.sampling.stop_token_ids:
            self._finish(seq, FinishReason.STOP)
        elif len(seq.generated) >= seq.job.max_new_tokens:
            self._finish(seq, FinishReason.LENGTH)

    def _finish(self, seq: RunningSequence, reason: FinishReason, error: str | None = None) -> None:
        if seq.lane >= 0 and self._lanes[seq.lane] is seq:
            self._lanes[seq.lane] = None
        now = time.perf_counter()
        result = JobResult(
            job_id=seq.handle.job_id,
            finish_reason=reason,
            tokens=tuple(seq.generated),
            kv_end=seq.kv_end,
            admitted_s=None if seq.admitted_at is None else seq.admitted_at - seq.submitted,
            first_token_s=None if seq.first_token_at is None else seq.first_token_at - seq.submitted,
            finished_s=now - seq.submitted,
            error=error,
        )
        seq.handle.deliver(result)

    def _shutdown(self) -> None:
        with self._cond:
            pending = list(self._waiting)
            self._waiting.clear()
            calls = list(self._calls)
            self._calls.clear()
            self._cond.notify_all()
        for _, future in calls:
            future.set_exception(RuntimeClosedError("the runtime closed before running this call"))
        for seq in pending + [s for s in self._lanes if s is not None]:
            self._finish(seq, FinishReason.CANCELLED)


def _call(fn: Callable[[], Any], future: Future[Any]) -> None:
    """Run ``fn`` into ``future`` on the device thread, outside inference mode (a caller's model may train)."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        with torch.inference_mode(False):
            future.set_result(fn())
    except BaseException as exc:  # the caller gets the error; the loop keeps serving
        future.set_exception(exc)
