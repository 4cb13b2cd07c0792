"""The worker-local controller: the pure worker machine backed by a real page pool and runtime.

It implements the transport's worker host (``heartbeat``, ``on_offer``,
``on_cancel``, ``on_fenced``, ``on_disconnect``) on one asyncio loop. Every protocol rule lives in
``kvrelay.core.worker.machine`` (the pure machine) and ``worker.admission``;
this module only carries effects:

- ``RequestAdmission`` -> ``admit`` against the pool (atomic reservation);
- ``StartWork`` -> restore (injected handler, on a thread, off the device
  loop), then one runtime job for the uncached tokens and the decode budget;
  the route is activated only after the restore copies completed; before the
  job enters the device queue the prefix is re-matched, and a run whose next
  chunk another started run is filling waits for it (``shared_prefill``); a
  continuation's job replays the delivered tokens past its resident prefix as
  decode rows (``Job.replay``), so it continues exactly as the first attempt
  would have;
- runtime token events -> ``TokensProduced`` -> deltas, as soon as they exist;
- ``FenceWork`` -> mark the job cancelled at once (the machine sends nothing
  more for it); the runtime answers once the step in flight has finished,
  which becomes ``WorkFinished``/``WorkQuiesced``;
- ``ReleaseReservation`` -> index the full chunks the sequence filled (they
  stay resident as cache), return the unused reserved pages, drop references.

Pages are consumed from the reservation as the sequence grows, and its full
chunks indexed, through ``worker.run_pages``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, assert_never

from kvrelay.core.worker import events as worker_events
from kvrelay.engines.machine_host import MachineHost
from kvrelay.protocol.chunk_keys import root_key
from kvrelay.protocol.messages import (
    Assignment,
    Fenced,
    FinishReason,
    Heartbeat,
    Offer,
    Residency,
    Tier,
    WireMessage,
)
from kvrelay.worker.accounting import learn_restore_rates, timings_of, usage_of
from kvrelay.worker.admission import WorkerIdentity, admit
from kvrelay.worker.handlers import Reply, RestoreHandler, Run
from kvrelay.worker.kv_capture import Checkpointer
from kvrelay.worker.page_pool import PagePool
from kvrelay.worker.reports import heartbeat_of, snapshot_parts
from kvrelay.worker.run_pages import register_chunks, replay_count, take_pages
from kvrelay.worker.runtime.jobs import Job, JobResult, RuntimeEvent, TokenEvent
from kvrelay.worker.runtime.loop import PagedRuntime
from kvrelay.worker.shared_prefill import FillingChunks, rematch

if TYPE_CHECKING:
    from kvrelay.telemetry.worker_spans import WorkerSpans

log = logging.getLogger(__name__)


class WorkerController(MachineHost):
    def __init__(
        self,
        identity: WorkerIdentity,
        pool: PagePool,
        runtime: PagedRuntime,
        kv_bytes_per_token: int,
        restore: RestoreHandler | None = None,
        checkpointer: Checkpointer | None = None,
        publish: Callable[[WireMessage], object] = lambda m: None,
        restore_bytes_per_s: Mapping[Tier, float] | None = None,
        clock: Callable[[], float] = time.monotonic,
        share_prefill: bool = True,
        exact_continuations: bool = True,
    ) -> None:
        """``share_prefill``: re-match a prefix before its prefill and wait for a run filling it (False: match
        at admission only, to compare). ``exact_continuations``: a continuation replays its delivered tokens
        as decode rows (False: prefills them with the prompt, faster to its first token but not bit-exact)."""
        super().__init__(identity.worker_id, identity.epoch, identity.model, identity.context_limit, publish, clock)
        self.me = identity
        self.pool = pool
        self.runtime = runtime
        self.kv_bytes_per_token = kv_bytes_per_token
        self.restorer = restore
        self.checkpointer = checkpointer
        self.peer_url = ""
        self.restore_bytes_per_s = dict(restore_bytes_per_s or {})
        self.share_prefill = share_prefill
        self.exact_continuations = exact_continuations
        self.filling = FillingChunks()
        self.runs: dict[Assignment, Run] = {}
        self._seq = 0
        self._pending_prefill_tokens = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self.pool_callback_errors = 0
        self._handing_over = False
        self.spans: WorkerSpans | None = None
        """Each attempt's spans, made at its release (``telemetry.worker_spans``); None: no tracing."""

    # --- transport-facing host interface ------------------------------------------

    def heartbeat(self) -> Heartbeat:
        """Fresh observations with the next sequence number (``worker.reports.heartbeat_of``)."""
        self._seq += 1
        return heartbeat_of(
            self.me,
            self._seq,
            self.pool,
            self.runtime,
            self.restorer,
            queued_tokens=self.queued_prefill_tokens(),
            now=time.monotonic(),
            restore_bytes_per_s=self.restore_bytes_per_s,
            kv_bytes_per_token=self.kv_bytes_per_token,
            peer_url=self.peer_url,
        )

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens of the accepted runs still to be written: restoring, waiting for a shared chunk, or
        in the runtime (less what its forwards wrote so far)."""
        if not self._pending_prefill_tokens:
            return 0
        left = 0
        for run in self.runs.values():
            if run.queued_tokens:
                written = run.handle.written if run.handle is not None else 0
                left += max(0, run.queued_tokens - written)
        return left

    def on_offer(self, offer: Offer, reply: Reply) -> None:
        self._loop = self._loop or asyncio.get_running_loop()
        super().on_offer(offer, reply)

    def on_disconnect(self, router_url: str) -> None:
        """A router connection ended, so that router fenced this epoch: move to a newer one (``_next_epoch``)."""
        self._next_epoch()
        log.info("worker %s: connection to %s lost; now epoch %d", self.worker_id, router_url, self.epoch)

    def on_fenced(self, fenced: Fenced) -> None:
        """A router says it fenced ``fenced.epoch`` (its heartbeats stopped reaching it in time, e.g. while an
        event loop stalled): if that is the current epoch, move to a newer one (``_next_epoch``); the link
        that carried the notice announces it with a heartbeat at once. A notice of an older epoch is ignored."""
        if fenced.worker_id != self.worker_id or fenced.epoch != self.epoch:
            return
        old = self.epoch
        self._next_epoch()
        log.warning(
            "worker %s: a router fenced epoch %d (%s); now epoch %d", self.worker_id, old, fenced.reason, self.epoch
        )

    def _next_epoch(self) -> None:
        """Continue in a newer epoch (wall-clock milliseconds, above the old one).

        Every assignment of the old epoch is fenced at once through the machine
        (as a cancel would: nothing more is sent for it, its pages are released
        once the step in flight has finished); later heartbeats and offers carry
        the new epoch, and heartbeat and residency sequences start again. Pages
        already filled stay resident as cache.
        """
        epoch = max(self.epoch + 1, time.time_ns() // 1_000_000)
        self._step(worker_events.EpochEnded(self.clock(), epoch))
        self.epoch = epoch
        self.me = dataclasses.replace(self.me, epoch=epoch)
        self._seq = self._residency_seq = 0

    def hand_over(self) -> int:
        """Stop every running assignment and end it with a ``cancelled`` Result carrying its tokens so far.

        The router continues such a request elsewhere as a continuation. Work
        not yet on the device is stopped as soon as it is submitted. Returns
        how many assignments were handed over.
        """
        self._handing_over = True
        running = [run for run in self.runs.values() if not run.fenced]
        for run in running:
            if run.handle is not None:
                run.handle.cancel()
        return len(running)

    def residency_snapshot(self) -> list[Residency]:
        """Everything each local tier (gpu, ram, ssd) holds now, as snapshot messages (``Residency.replace``).

        The transport sends them on a link that just came up, right after the first heartbeat of the epoch, so
        the router's index lists exactly what this worker holds: chunks cached before a lost connection stay
        routable, and what a restart lost (a wiped chunk directory) is forgotten. A tier's keys go in parts of
        ``worker.reports.SNAPSHOT_KEYS``; the first part replaces, the rest add.
        """
        parts = snapshot_parts(self.pool, self.restorer)
        return [self.residency(tier, keys, replace=replace) for tier, keys, replace in parts]

    # --- the machine and its effects ------------------------------------------------

    def _admit(self, offer: Offer) -> None:
        offered_at = self.clock()
        result = admit(self.pool, self.me, offer, self.state.shutting_down)
        if result.accepted:
            assert result.reservation is not None
            prefix_pages = [p for pages in result.prefix for p in pages]
            run = Run(
                offer,
                self._replies[offer.assignment],
                result,
                prefix_pages + list(result.reservation.pages),
                taken=len(prefix_pages),
                registered=len(result.prefix),
                parent_key=result.chain[len(result.prefix) - 1] if result.prefix else root_key(self.me.fingerprint),
                offered_at=offered_at,
                accepted_at=self.clock(),
            )
            if result.prefix:
                run.cached_tokens["gpu"] = len(result.prefix) * self.me.chunk_tokens
            self.runs[offer.assignment] = run
        elif self.spans is not None:
            self._trace(self.spans.declined, offer, offered_at, self.clock(), result.reason, result.detail)
        self._step(
            worker_events.AdmissionDecided(
                self.clock(), offer.assignment, result.accepted, result.reason, result.detail
            )
        )

    def _start(self, offer: Offer) -> None:
        run = self.runs[offer.assignment]
        ppc = self.pool.pages_per_chunk
        wanted = len(run.admission.chain) - run.registered
        if self.restorer is not None and wanted > 0 and any(s.tier not in ("gpu", "recompute") for s in offer.route):
            keys = run.admission.chain[run.registered :]
            first = run.taken
            pages = [run.page_table[first + i * ppc : first + (i + 1) * ppc] for i in range(wanted)]
            run.restoring = True
            run.restore_started_at = self.clock()
            # Queued from its acceptance, as the router expects (``predicted_ttft.WorkerLoad``): what the
            # route leaves to prefill; ``_submit`` sets what the restore really left.
            self._queue_tokens(run, len(offer.prompt) - len(run.admission.chain) * self.me.chunk_tokens)
            if self.share_prefill:
                self.filling.claim(run, keys)
            asyncio.get_running_loop().create_task(self._restore_then_submit(run, keys, pages))
        else:
            self._submit(run)

    async def _restore_then_submit(self, run: Run, keys: tuple[bytes, ...], pages: list[list[int]]) -> None:
        assert self.restorer is not None
        try:
            report = await asyncio.to_thread(self.restorer.restore, run.offer, keys, pages)
        except Exception:
            log.exception("restore of %s failed; recomputing", run.offer.assignment)
            report = None
        run.restoring = False
        if report is not None:
            run.restore_s = report.seconds
            learn_restore_rates(self.restore_bytes_per_s, report)
            for tier, n in report.bytes_by_tier.items():
                run.bytes_by_tier[tier] = run.bytes_by_tier.get(tier, 0) + n
            for tier in report.tiers:
                run.cached_tokens[tier] = run.cached_tokens.get(tier, 0) + self.me.chunk_tokens
            take_pages(self.pool, run, run.taken + len(report.tiers) * self.pool.pages_per_chunk)
            run.kv_end = (run.registered + len(report.tiers)) * self.me.chunk_tokens
            self._register(run, run.registered + len(report.tiers), run.offer.prompt)
        waiters = self.filling.filled(run)
        if run.fenced:
            self._step(worker_events.WorkQuiesced(self.clock(), run.offer.assignment))
        else:
            self._submit(run)
        self._resubmit(waiters)

    def _submit(self, run: Run) -> None:
        """Re-match the prefix and enter the device queue, or wait for the run filling the next chunk."""
        if self.share_prefill:
            rematch(self.pool, run, self.me.chunk_tokens)
            rest = run.admission.chain[run.registered :]
            filler = self.filling.filler_of(rest[0], run) if rest else None
            if filler is not None:
                shared = self.filling.claimed_run(rest, run)
                self._queue_tokens(run, len(run.offer.prompt) - (run.registered + shared) * self.me.chunk_tokens)
                self.filling.wait(run, filler)
                if filler.handle is not None:  # on the device: it holds the forward after its first token for run
                    filler.handle.expect_followers()
                return
            self.filling.claim(run, rest)
        cached = run.registered * self.me.chunk_tokens
        offer = run.offer
        job = Job(
            tokens=offer.prompt[cached:],
            page_table=tuple(run.page_table),
            start_pos=cached,
            max_new_tokens=offer.max_new_tokens,
            sampling=offer.sampling,
            priority=offer.priority,
            place=run.accepted_at,
            replay=replay_count(offer, cached, self.exact_continuations),
        )
        loop = asyncio.get_running_loop()
        self._queue_tokens(run, job.prefill_len)
        run.submitted_at = self.clock()

        def on_event(event: RuntimeEvent) -> None:
            loop.call_soon_threadsafe(self._on_runtime_event, run, event)

        run.handle = self.runtime.submit(job, on_event, timeout=0)
        if self._handing_over:
            run.handle.cancel()

    def _on_runtime_event(self, run: Run, event: RuntimeEvent) -> None:
        match event:
            case TokenEvent():
                self._on_token(run, event)
            case JobResult():
                self._on_job_result(run, event)
            case _:
                assert_never(event)

    def _queue_tokens(self, run: Run, tokens: int) -> None:
        """Set the prompt tokens ``run`` adds to the reported queue."""
        self._pending_prefill_tokens += tokens - run.queued_tokens
        run.queued_tokens = tokens

    def _resubmit(self, waiters: list[Run]) -> None:
        """The run these waited for registered its chunks or ended: they re-match and go on."""
        for waiter in waiters:
            if not waiter.fenced:
                self._submit(waiter)

    def _on_token(self, run: Run, event: TokenEvent) -> None:
        now = self.clock()
        take_pages(self.pool, run, event.position // self.pool.page_tokens + 1)
        if not run.generated:
            self._queue_tokens(run, 0)
            self._register(run, len(run.offer.prompt) // self.me.chunk_tokens, run.offer.prompt)
            self._resubmit(self.filling.filled(run))
            if run.handle is not None:
                run.handle.followers_submitted()
        first = not run.generated
        run.token_times.append(now)
        run.generated.append(event.token)
        self._step(worker_events.TokensProduced(now, run.offer.assignment, (event.token,)))
        if first:
            # Its prefill left the queue: tell the routers now, after its first delta, not at the next periodic
            # heartbeat (a router holding requests while the queue looked long sent them up to 0.5 s late).
            self.publish(self.heartbeat())

    def _on_job_result(self, run: Run, event: JobResult) -> None:
        a = run.offer.assignment
        self._queue_tokens(run, 0)
        run.kv_end = event.kv_end
        run.finish_reason = event.finish_reason
        if event.finish_reason == FinishReason.CANCELLED and run.fenced:
            self._step(worker_events.WorkQuiesced(self.clock(), a))
            return
        self._step(
            worker_events.WorkFinished(
                self.clock(), a, event.finish_reason, usage_of(run), timings_of(run), event.error
            )
        )

    def _fence(self, assignment: Assignment) -> None:
        run = self.runs.get(assignment)
        if run is None:
            return
        run.fenced = True
        if run.handle is not None:
            run.handle.cancel()
        elif self.filling.is_waiting(run):  # no work in flight: quiescent now (after this step's effects)
            self.filling.forget_waiter(run)
            self._queue_tokens(run, 0)
            asyncio.get_running_loop().call_soon(self._step, worker_events.WorkQuiesced(self.clock(), assignment))

    def _release(self, assignment: Assignment) -> None:
        run = self.runs.pop(assignment, None)
        self._replies.pop(assignment, None)
        if run is None:
            return
        written = max(run.kv_end, run.registered * self.me.chunk_tokens)
        take_pages(self.pool, run, -(-written // self.pool.page_tokens))
        self._register(run, written // self.me.chunk_tokens, run.offer.prompt + tuple(run.generated))
        reservation = run.admission.reservation
        assert reservation is not None
        self.pool.release(reservation)
        self.pool.unref(run.page_table[: run.taken])
        self._resubmit(self.filling.filled(run))
        if self.spans is not None:
            self._trace(self.spans.ended, run, self.clock())

    def _trace(self, spans: Callable[..., None], *args: object) -> None:
        """Make spans; a failure is logged, never breaks the worker."""
        try:
            spans(*args)
        except Exception:
            log.exception("tracing an attempt on worker %s failed", self.worker_id)

    def _register(self, run: Run, chunks: int, tokens: tuple[int, ...]) -> None:
        """Index ``run``'s full chunks of ``tokens`` up to ``chunks`` (``run_pages.register_chunks``)."""
        register_chunks(self.pool, run, chunks, tokens, self.me.chunk_tokens, self.checkpointer)
