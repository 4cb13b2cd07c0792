"""A simulated worker: the pure worker machine plus declared costs, caches and batching.

It carries the machine's effects (``core.worker.machine.step``) and holds no protocol rule:
admission is ``sim.admission.plan_admission``; fencing, deltas and results come
from the machine.

Execution model (declared costs, logical time):

- Admission: decided when the offer arrives, or ``admission_s`` later (a worker
  busy reserving pages), which opens the window for a cancel before acceptance.
- Restore: an accepted assignment first restores its non-gpu prefix on the
  worker's one restore channel (FIFO), taking ``bytes / rate`` per tier.
- The device: one iteration at a time, its prefills, re-matching and deltas as
  ``sim.iteration`` states.
- A fenced assignment stops at once; its reservation is released when the
  restore or iteration it is part of ends (``WorkQuiesced``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import assert_never

from kvrelay.core.worker import events as worker_events
from kvrelay.core.worker import machine
from kvrelay.protocol.chunk_keys import prompt_chain
from kvrelay.protocol.messages import (
    Assignment,
    Fenced,
    FinishReason,
    Heartbeat,
    Offer,
    Timings,
    Usage,
    WireMessage,
)
from kvrelay.sim.admission import (
    AdmissionDecline,
    AdmissionPlan,
    plan_admission,
)
from kvrelay.sim.cache import SharedObjectTier, WorkerCaches
from kvrelay.sim.chunk_origins import ChunkOrigins
from kvrelay.sim.cluster_config import ClusterConfig, WorkerSpec
from kvrelay.sim.events import AdmissionDue, IterationDone, RestoreDone, WorkerDue
from kvrelay.sim.filling import Filling
from kvrelay.sim.iteration import delta_of, enqueue, prefill_to_do, take_prefills
from kvrelay.sim.observations import heartbeat_of, residency_messages
from kvrelay.sim.work import Work, WorkerStats, iteration_s, timings_of, usage_of

Schedule = Callable[[float, str, int, WorkerDue], None]
"""``schedule(at, worker_id, incarnation, event)``: hand ``event`` to ``SimWorker.on_due`` at ``at`` if that
process (``SimWorker.incarnation``) still runs."""
Send = Callable[[float, str, WireMessage], None]


class SimWorker:
    """One simulated worker process across crashes: each start is a new ``incarnation`` and a new epoch, and a
    ``Fenced`` notice of the current epoch moves the running process to a newer epoch."""

    def __init__(
        self,
        worker_id: str,
        cluster: ClusterConfig,
        shared: SharedObjectTier,
        peers: dict[str, WorkerCaches],
        schedule: Schedule,
        send: Send,
        delta_tokens: int = 1,
        known_chains: dict[str, tuple[bytes, ...]] | None = None,
        admission_s: float = 0.0,
        rematch: bool = True,
        spec: WorkerSpec | None = None,
        origins: ChunkOrigins | None = None,
    ) -> None:
        """``rematch``: re-match the prefix when a prefill starts (False: only at admission, to compare);
        ``spec``: this worker's costs and capacities (default: the cluster's ``worker``); ``origins``: the
        cluster's record of which request first computed each chunk (shared by the workers)."""
        w = spec if spec is not None else cluster.worker
        self.worker_id, self.cluster, self.spec = worker_id, cluster, w
        self.rates = cluster.rates_of(w)
        self.schedule, self.send, self.delta_tokens = schedule, send, max(1, delta_tokens)
        self.peers = peers  # caches of the live workers: peer restores read their ram and ssd
        self.admission_s = admission_s
        self.rematch = rematch
        self.origins = origins if origins is not None else ChunkOrigins(cluster.chunk_tokens)
        self.known_chains = known_chains if known_chains is not None else {}
        self._chain_memo: dict[tuple[str, int], tuple[bytes, ...]] = {}
        chunk_pages = cluster.chunk_tokens // cluster.page_tokens
        self.caches = WorkerCaches(
            w.gpu_kv_tokens // cluster.page_tokens,
            chunk_pages,
            w.ram_kv_tokens // cluster.chunk_tokens if "ram" in cluster.tiers else 0,
            w.ssd_kv_tokens // cluster.chunk_tokens if "ssd" in cluster.tiers else 0,
            shared,
            cluster.object_write_through and "object" in cluster.tiers,
        )
        self.epoch = 0
        self.incarnation = 0
        self.alive = False
        self.state = machine.new_worker(worker_id, 0, (cluster.model,), w.context_limit)
        self.stats = WorkerStats()
        self._reset_runtime()

    def _reset_runtime(self) -> None:
        self.plans: dict[Assignment, AdmissionPlan] = {}
        self.works: dict[Assignment, Work] = {}
        self.filling = Filling()
        self.prefill_queue: list[Work] = []
        self.decoding: list[Work] = []
        self.busy = False
        self.restore_free_at = 0.0
        self.heartbeat_seq = 0
        self.residency_seq = 0

    # --- lifecycle ---------------------------------------------------------------

    def start(self, now: float) -> None:
        """Start a new process and epoch: a fresh machine and runtime; ssd and the object tier survive."""
        self.epoch += 1
        self.incarnation += 1
        self.alive = True
        self.peers[self.worker_id] = self.caches
        self.state = machine.new_worker(self.worker_id, self.epoch, (self.cluster.model,), self.spec.context_limit)
        self._reset_runtime()
        self.restore_free_at = now

    def crash(self) -> None:
        """Lose the process: machine, runtime, gpu and ram."""
        self.alive = False
        self.peers.pop(self.worker_id, None)
        self.caches.lose_volatile()
        self._reset_runtime()
        self.state = machine.new_worker(self.worker_id, self.epoch, (self.cluster.model,), self.spec.context_limit)

    def on_fenced(self, now: float, fenced: Fenced) -> None:
        """The router fenced ``fenced.epoch``: if that is the current one, go on in the next epoch (the machine
        fences every assignment of the old one); the process, its pages and caches go on."""
        if fenced.epoch != self.epoch:
            return
        self.epoch += 1
        self.heartbeat_seq = self.residency_seq = 0
        self.deliver(now, worker_events.EpochEnded(now, self.epoch))

    def holds_reservations(self) -> bool:
        return machine.holds_reservations(self.state) or self.caches.gpu.reserved > 0 or bool(self.works)

    # --- observations --------------------------------------------------------------

    def heartbeat(self, now: float) -> Heartbeat:
        gpu, w = self.caches.gpu, self.spec
        waiting = self.prefill_queue + [x for x in self.works.values() if x.restore_done_at > now]
        self.heartbeat_seq += 1
        if self.heartbeat_seq == 2 and self.epoch > 1:
            self.caches.announce_durable()  # once the router knows this epoch (after the first heartbeat)
        filling = self.filling if self.rematch else None
        queued = sum(prefill_to_do(x, filling, self.caches, self.cluster.chunk_tokens) for x in waiting)
        load = max(0.0, self.restore_free_at - now)
        return heartbeat_of(
            self.worker_id,
            self.epoch,
            self.heartbeat_seq,
            self.cluster,
            w,
            gpu,
            self.rates,
            queued,
            load,
            len(self.decoding),
        )

    def flush_residency(self, now: float) -> None:
        """Send the buffered residency changes, one message per tier."""
        messages = residency_messages(
            self.worker_id, self.epoch, self.residency_seq, self.cluster.model, self.caches.drain_changes()
        )
        for message in messages:
            self.send(now, self.worker_id, message)
        self.residency_seq += len(messages)

    # --- the machine and its effects -------------------------------------------------

    def deliver(self, now: float, event: worker_events.WorkerEvent) -> None:
        """Feed one event to the machine, carry out its effects, then let the device run."""
        self._feed(now, [event])
        self._maybe_iterate(now)
        self.flush_residency(now)

    def _feed(self, now: float, events: list[worker_events.WorkerEvent]) -> None:
        queue = list(events)
        while queue:
            self.state, effects = machine.step(self.state, queue.pop(0))
            for effect in effects:
                follow = self._carry(now, effect)
                if follow is not None:
                    queue.append(follow)

    def _carry(self, now: float, effect: worker_events.WorkerEffect) -> worker_events.WorkerEvent | None:
        match effect:
            case worker_events.SendMessage(message=message):
                self.send(now, self.worker_id, message)
            case worker_events.RequestAdmission(offer=offer):
                if self.admission_s > 0:
                    self.schedule(now + self.admission_s, self.worker_id, self.incarnation, AdmissionDue(offer))
                    return None
                return self._admit(now, offer)
            case worker_events.StartWork(offer=offer):
                self._start_work(now, offer)
            case worker_events.FenceWork(assignment=assignment):
                return self._fence(now, assignment)
            case worker_events.ReleaseReservation(assignment=assignment):
                self._release(assignment)
            case _:
                assert_never(effect)
        return None

    def chain_of(self, offer: Offer) -> tuple[bytes, ...]:
        """The chunk chain of the offer's prompt: as ingress gave it (a trace's), else from the tokens."""
        known = self.known_chains.get(offer.assignment.request_id)
        if known is not None:
            return known
        memo_key = (offer.assignment.request_id, len(offer.prompt))
        chain = self._chain_memo.get(memo_key)
        if chain is None:
            chain = self._chain_memo[memo_key] = prompt_chain(
                self.cluster.fingerprint, offer.prompt, self.cluster.chunk_tokens
            )
        return chain

    def _admit(self, now: float, offer: Offer) -> worker_events.AdmissionDecided:
        peers = self.peers if "peer" in self.cluster.tiers else {}
        decision = plan_admission(offer, self.chain_of(offer), self.caches, peers, self.cluster, self.rates)
        if isinstance(decision, AdmissionDecline):
            return worker_events.AdmissionDecided(now, offer.assignment, False, decision.reason, decision.detail)
        for key in decision.gpu_keys:
            self.caches.gpu.pin(key)
        self.caches.reserve(decision.demand_pages)
        self.plans[offer.assignment] = decision
        return worker_events.AdmissionDecided(now, offer.assignment, True)

    def _start_work(self, now: float, offer: Offer) -> None:
        plan = self.plans.pop(offer.assignment)
        work = Work(
            offer, plan, plan.demand_pages, list(plan.gpu_keys), now, plan.uncached_tokens, list(plan.computed_keys)
        )
        self.works[offer.assignment] = work
        self.stats.accepted += 1
        if plan.restore:
            if self.rematch:
                self.filling.claim(work, [k for k, _ in plan.restore])
            start = max(now, self.restore_free_at)
            work.restore_done_at = self.restore_free_at = start + plan.restore_s
            work.in_flight = True
            self.schedule(work.restore_done_at, self.worker_id, self.incarnation, RestoreDone(offer.assignment))
        else:
            enqueue(self.prefill_queue, work)

    def _fence(self, now: float, assignment: Assignment) -> worker_events.WorkerEvent | None:
        work = self.works[assignment]
        work.fenced = True
        if work.in_flight:
            return None
        self._drop(work)
        return worker_events.WorkQuiesced(now, assignment)

    def _drop(self, work: Work) -> None:
        if work in self.prefill_queue:
            self.prefill_queue.remove(work)
        if work in self.decoding:
            self.decoding.remove(work)
        self.filling.unclaim(work, work.computed)
        self.filling.unclaim(work, [k for k, _ in work.plan.restore])

    def _release(self, assignment: Assignment) -> None:
        plan = self.plans.pop(assignment, None)
        if plan is not None:  # released between admission and start (fenced while admitting)
            for key in plan.gpu_keys:
                self.caches.gpu.unpin(key)
            self.caches.release(plan.demand_pages)
            return
        work = self.works.pop(assignment)
        for key in work.pinned:
            self.caches.gpu.unpin(key)
        self.caches.release(work.reserved_pages)

    def _fill_gpu(self, work: Work, keys: list[bytes], computed: bool) -> None:
        for key in keys:
            if self.caches.add_to_gpu(key, computed):
                work.reserved_pages -= self.caches.gpu.chunk_pages
            work.pinned.append(key)

    # --- scheduled events ---------------------------------------------------------

    def on_due(self, now: float, event: WorkerDue) -> None:
        """Handle an event this worker scheduled (the caller checked that its epoch still holds)."""
        match event:
            case AdmissionDue(offer=offer):
                self.deliver(now, self._admit(now, offer))
            case RestoreDone(assignment=assignment):
                self._restore_done(now, assignment)
            case IterationDone(decode=decode, prefill=prefill):
                self._iteration_done(now, decode, prefill)
            case _:
                assert_never(event)

    def _restore_done(self, now: float, assignment: Assignment) -> None:
        work = self.works[assignment]
        work.in_flight = False
        restored = [k for k, _ in work.plan.restore]
        self._fill_gpu(work, restored, computed=False)
        self.filling.unclaim(work, restored)
        for tier, n in work.plan.restore_bytes.items():
            self.stats.restored_bytes[tier] = self.stats.restored_bytes.get(tier, 0) + n
        if work.fenced:
            self._feed(now, [worker_events.WorkQuiesced(now, assignment)])
        else:
            enqueue(self.prefill_queue, work)
        self._maybe_iterate(now)
        self.flush_residency(now)

    def _maybe_iterate(self, now: float) -> None:
        if self.busy or not self.alive:
            return
        w = self.spec
        decode = list(self.decoding)
        prefill = take_prefills(
            self.prefill_queue,
            w.max_lanes - len(decode),
            w.prefill_chunk_tokens,
            now,
            self.caches,
            self.filling if self.rematch else None,
            self.cluster.chunk_tokens,
            self.stats,
        )
        if not decode and not prefill:
            return
        tokens = sum(t for _, t in prefill)
        duration = iteration_s(w, len(decode), tokens)
        for work in decode:
            work.in_flight = True
        for work, _ in prefill:
            work.in_flight = True
        self.busy = True
        self.stats.busy_s += duration
        self.stats.prefill_tokens += tokens
        self.schedule(now + duration, self.worker_id, self.incarnation, IterationDone(decode, prefill))

    def _iteration_done(self, now: float, decode: list[Work], prefill: list[tuple[Work, int]]) -> None:
        self.busy = False
        events: list[worker_events.WorkerEvent] = []
        for work in decode:
            work.in_flight = False
            if work.fenced:
                self._drop(work)
                events.append(worker_events.WorkQuiesced(now, work.offer.assignment))
                continue
            work.generated += 1
            events += self._progress(now, work)
        for work, take in prefill:
            work.in_flight = False
            work.prefill_left -= take
            if work.fenced:
                self._drop(work)
                events.append(worker_events.WorkQuiesced(now, work.offer.assignment))
            elif work.prefill_left == 0:
                self.prefill_queue.remove(work)
                self._fill_gpu(work, work.computed, computed=True)
                self.origins.computed(work.computed, work.offer.assignment.request_id)
                self.filling.unclaim(work, work.computed)
                work.generated = 1
                work.first_token_at = now
                self.decoding.append(work)
                events += self._progress(now, work)
        self._feed(now, events)
        self._maybe_iterate(now)
        self.flush_residency(now)

    def _progress(self, now: float, work: Work) -> list[worker_events.WorkerEvent]:
        """Events for new tokens of ``work`` (a delta when due) and its finish."""
        offer = work.offer
        done = work.generated >= offer.max_new_tokens
        delta = delta_of(now, work, self.delta_tokens)
        events: list[worker_events.WorkerEvent] = [] if delta is None else [delta]
        if done:
            self.decoding.remove(work)
            self.stats.finished += 1
            self.stats.generated_tokens += work.generated
            events.append(
                worker_events.WorkFinished(
                    now, offer.assignment, FinishReason.LENGTH, self._usage(work), self._timings(work)
                )
            )
        return events

    def _usage(self, work: Work) -> Usage:
        plan = work.plan
        self.origins.reported([*plan.gpu_keys, *(k for k, _ in plan.restore)], work.offer.assignment.request_id)
        return usage_of(work, self.cluster.chunk_tokens)

    def _timings(self, work: Work) -> Timings:
        return timings_of(work, self.cluster.chunk_tokens, self.spec.prefill_s_per_token)
