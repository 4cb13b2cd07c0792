"""The vLLM worker: the pure worker machine carried out against a vLLM OpenAI server (docs/design.md section 13).

``VllmWorker`` is a second implementation of the host the worker transport
drives (``heartbeat``, ``on_offer``, ``on_cancel``, ``on_disconnect``, ``on_fenced``), beside
``worker/host.py``'s ``WorkerController``. The protocol (fencing, stale
attempts, deltas with sequence numbers, results) is the same machine,
``core/worker/machine.py``; only its effects differ:

- ``RequestAdmission`` -> ``admission.admit_offer`` against the mirror of the
  engine's blocks (its KV events) and capacity (its ``/metrics`` and this
  worker's promises);
- ``StartWork`` -> a streaming token-id completion of the offer's prompt
  (continuations included: the prompt holds the tokens delivered before) with
  the remaining budget; each chunk's token ids -> ``TokensProduced``; the end
  -> ``WorkFinished`` with the cached tokens vLLM reports (tier ``gpu``);
- ``FenceWork`` -> the stream is closed, which makes vLLM abort the request;
  once the stream task has ended -> ``WorkQuiesced``;
- ``ReleaseReservation`` -> the request's promised blocks are returned.

Residency: each KV event frame updates the mirror and becomes one
``Residency`` message (tier ``gpu``). A lost router connection starts a new
epoch but keeps the mirror, which is published whole right after the new
epoch's first heartbeat. Other epochs: a gap in the frames' sequence,
a sequence that went back (a restarted publisher), ``AllBlocksCleared``, a
reconnection of the event stream, and the engine becoming unreachable or
coming back all start a new epoch (``begin_epoch``): the mirror is cleared,
every assignment of the old epoch is fenced, and the next heartbeat makes the
router drop everything it believed about the old one, so its index never
credits KV that is gone. A stream that breaks ends its assignment with an
error; the router continues the request elsewhere with the tokens delivered.

Speeds: the heartbeat's prefill rate, its decode step (the fixed part of the time to a first token,
which the router adds once) and its cost per request in flight come from ``served.ServedSpeeds``: the
engine's own ``/metrics`` fit (``speeds.PrefillFit``: prefill time against computed tokens, without vLLM's
queueing) until this worker has measured a few first tokens of its own, then the fit of those against the
uncached tokens each waited for (``EngineRun.waited_tokens``) and the other runs in flight when it was
accepted (``EngineRun.in_flight``), aged with time so that an idle worker reports the engine's fit again
(``ServedSpeeds.rested``); its queue from the uncached prompt tokens of this worker's requests that
have no first token yet.

Sampling: the attempt's vLLM ``seed`` is derived from the request's seed and
``generated_before`` (``attempt_seed``), so an attempt is reproducible; a
continuation does not redraw what the first attempt would have drawn, as a
native worker's per-position seeding does (greedy decoding is exact).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from kvrelay.core.worker import events as worker_events
from kvrelay.engines.machine_host import MachineHost
from kvrelay.engines.vllm import kv_events
from kvrelay.engines.vllm.admission import EngineCapacity, EngineIdentity, admit_offer
from kvrelay.engines.vllm.client import EngineError, VllmEngine
from kvrelay.engines.vllm.metrics import EngineFigures
from kvrelay.engines.vllm.served import ServedSpeeds
from kvrelay.engines.vllm.speeds import PrefillFit, queue_delay
from kvrelay.protocol.chunk_keys import root_key
from kvrelay.protocol.messages import (
    Assignment,
    Cancel,
    Fenced,
    FinishReason,
    Heartbeat,
    Offer,
    Timings,
    Usage,
    WireMessage,
)

log = logging.getLogger(__name__)


def attempt_seed(seed: int, generated_before: int) -> int:
    """The vLLM seed of one attempt: a 63-bit digest of the request's seed and the tokens delivered before."""
    digest = hashlib.blake2b(f"{seed}:{generated_before}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass(slots=True)
class EngineRun:
    """One admitted assignment, from admission to release."""

    offer: Offer
    demand_blocks: int
    prefix_chunks: int
    accepted_at: float
    task: asyncio.Task[None] | None = None
    fenced: bool = False
    generated: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    submitted_at: float = 0.0
    cached_tokens: int = 0
    waited_tokens: int = 0
    """Uncached prompt tokens this run's first token waits for: its own and those of the runs admitted before
    it that had no first token yet (``served.ServedSpeeds``)."""
    in_flight: int = 0
    """The other runs on this worker when this one was accepted (``served.ServedSpeeds``)."""


class VllmWorker(MachineHost):
    """A worker host whose runtime side is one vLLM engine (see the module docstring)."""

    def __init__(
        self,
        identity: EngineIdentity,
        engine: VllmEngine,
        engine_model: str,
        kv_bytes_per_token: int,
        max_lanes: int,
        figures: EngineFigures,
        publish: Callable[[WireMessage], object] = lambda m: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(identity.worker_id, identity.epoch, identity.model, identity.context_limit, publish, clock)
        self.me = identity
        self.engine = engine
        self.engine_model = engine_model
        self.kv_bytes_per_token = kv_bytes_per_token
        self.max_lanes = max_lanes
        self.figures = figures
        self.peer_url = ""
        self.engine_up = True
        self.speeds = ServedSpeeds(PrefillFit().observe(figures.totals))
        self.mirror = kv_events.BlockMirror(root_key(identity.fingerprint), identity.block_tokens)
        self.runs: dict[Assignment, EngineRun] = {}
        self.counters: dict[str, int] = {}
        self._seq = 0
        self._last_frame: int | None = None
        self._handing_over = False
        self._republish = False
        self._freed_blocks = 0
        """Promised blocks of runs that ended since the last ``/metrics`` figures arrived, which those figures
        may still count in use (``capacity``)."""

    # --- transport-facing host interface ------------------------------------------

    def heartbeat(self) -> Heartbeat:
        """vLLM's figures (blocks, requests) with this worker's promises and measured speeds; the next seq."""
        self._seq += 1
        if self._republish and self.mirror.keys:
            self._republish = False
            asyncio.get_running_loop().call_soon(self.publish_residency, tuple(self.mirror.keys), ())
        capacity = self.capacity()
        pending = self._pending_tokens()
        fixed_s, prefill_s_per_token, per_request_s = self.speeds.rested(self.clock()).reported()
        return Heartbeat(
            worker_id=self.worker_id,
            epoch=self.epoch,
            seq=self._seq,
            models=(self.me.model,),
            model_fingerprints=(self.me.fingerprint.hex(),),
            pages_total=capacity.total_blocks,
            pages_free=capacity.free_blocks if self.engine_up else 0,
            pages_reserved=capacity.promised_blocks,
            page_tokens=self.me.block_tokens,
            chunk_tokens=self.me.block_tokens,
            queue_delay_s=queue_delay(pending, prefill_s_per_token),
            active_lanes=max(self.figures.running, len(self.runs)),
            max_lanes=self.max_lanes,
            prefill_s_per_token=prefill_s_per_token,
            decode_s_per_token=fixed_s,
            per_request_s=per_request_s,
            kv_bytes_per_token=self.kv_bytes_per_token,
            context_limit=self.me.context_limit,
        )

    def _uncached(self, run: EngineRun) -> int:
        return max(0, len(run.offer.prompt) - run.prefix_chunks * self.me.block_tokens)

    def _pending_tokens(self) -> int:
        """Uncached prompt tokens of the runs without a first token yet."""
        return sum(self._uncached(r) for r in self.runs.values() if not r.generated)

    def capacity(self) -> EngineCapacity:
        """The engine's blocks now: vLLM's last figure of those in use, less what runs that ended since gave
        back (a poll a second old would otherwise hold them for up to a second), and this worker's promises."""
        promised = sum(r.demand_blocks for r in self.runs.values())
        used = max(0, self.figures.used_blocks - self._freed_blocks)
        return EngineCapacity(self.figures.num_blocks, used, promised)

    def on_disconnect(self, router_url: str) -> None:
        """A router connection ended, so that router fenced this epoch: move to a newer one."""
        self.begin_epoch(f"connection to {router_url} lost", clear_mirror=False)

    def on_fenced(self, fenced: Fenced) -> None:
        """A router says it fenced the current epoch: move to a newer one (a notice of an older epoch is ignored)."""
        if fenced.worker_id == self.worker_id and fenced.epoch == self.epoch:
            self.begin_epoch(f"a router fenced epoch {fenced.epoch}", clear_mirror=False)

    def hand_over(self) -> int:
        """End every running assignment with a ``cancelled`` Result carrying its tokens so far (a continuation)."""
        self._handing_over = True
        running = [run for run in self.runs.values() if not run.fenced]
        for run in running:
            if run.task is not None:
                run.task.cancel()
        return len(running)

    # --- epochs and residency ------------------------------------------------------

    def begin_epoch(self, why: str, clear_mirror: bool = True) -> None:
        """Fence every assignment of the current epoch and move to a newer one (see the module docstring)."""
        now = self.clock()
        for assignment in list(self.state.slots):
            self._step(
                worker_events.CancelReceived(now, Cancel(assignment=assignment, worker_id=self.worker_id, reason=why))
            )
        if clear_mirror:
            self.mirror.clear()
        self._republish = not clear_mirror
        self.epoch = max(self.epoch + 1, time.time_ns() // 1_000_000)
        self.state.epoch = self.epoch
        self.me = dataclasses.replace(self.me, epoch=self.epoch)
        self._count("epochs")
        log.info("vLLM worker %s: %s; now epoch %d", self.worker_id, why, self.epoch)

    def on_kv_frame(self, parts: list[bytes]) -> None:
        """One frame of the engine's KV events: update the mirror, publish the change (or start a new epoch)."""
        try:
            seq, batch = kv_events.decode_frame(parts)
        except kv_events.KvEventError as exc:
            self._count("kv_frames_malformed")
            log.warning("vLLM worker %s: KV event frame dropped: %s", self.worker_id, exc)
            return
        kind = kv_events.continuity(self._last_frame, seq)
        self._last_frame = seq
        if kind in (kv_events.Continuity.GAP, kv_events.Continuity.RESTARTED):
            self.begin_epoch(f"KV event stream {kind.value} at seq {seq}")
        change = kv_events.apply_batch(self.mirror, batch.events)
        if change.cleared:
            self.begin_epoch("the engine cleared its KV cache", clear_mirror=False)
            change = kv_events.MirrorChange(stored=change.stored)
        if change.stored or change.removed:
            self.publish_residency(change.stored, change.removed)

    def on_kv_reconnect(self) -> None:
        self._last_frame = None
        self.begin_epoch("the KV event stream reconnected")

    def on_figures(self, figures: EngineFigures | None) -> None:
        """The latest ``/metrics`` figures, or None when the engine did not answer."""
        if figures is None:
            if self.engine_up:
                self.engine_up = False
                self.begin_epoch(f"the vLLM engine at {self.engine.url} is unreachable")
            return
        if not self.engine_up:
            self.engine_up = True
            self._last_frame = None
            self.begin_epoch(f"the vLLM engine at {self.engine.url} is back")
        self.figures = figures
        self._freed_blocks = 0
        self.speeds = replace(self.speeds, engine=self.speeds.engine.observe(figures.totals))

    async def monitor(self, every_s: float) -> None:
        """Poll the engine's ``/metrics`` every ``every_s`` seconds until cancelled."""
        while True:
            try:
                figures: EngineFigures | None = await self.engine.figures()
            except EngineError as exc:
                log.debug("vLLM worker %s: %s", self.worker_id, exc)
                figures = None
            self.on_figures(figures)
            await asyncio.sleep(every_s)

    # --- the machine and its effects ------------------------------------------------

    def _count(self, name: str) -> None:
        self.counters[name] = self.counters.get(name, 0) + 1

    def _release(self, assignment: Assignment) -> None:
        run = self.runs.pop(assignment, None)
        if run is not None:
            self._freed_blocks += run.demand_blocks
        self._replies.pop(assignment, None)

    def _admit(self, offer: Offer) -> None:
        result = admit_offer(
            self.me, offer, self.capacity(), self.mirror.keys, self.engine_up, self.state.shutting_down
        )
        if result.accepted:
            run = EngineRun(offer, result.demand_blocks, result.prefix_chunks, self.clock(), in_flight=len(self.runs))
            run.waited_tokens = self._pending_tokens() + self._uncached(run)
            self.runs[offer.assignment] = run
        self._step(
            worker_events.AdmissionDecided(
                self.clock(), offer.assignment, result.accepted, result.reason, result.detail
            )
        )

    def _start(self, offer: Offer) -> None:
        run = self.runs[offer.assignment]
        run.submitted_at = self.clock()
        run.task = asyncio.get_running_loop().create_task(self._generate(run))
        if self._handing_over:
            run.task.cancel()

    def _fence(self, assignment: Assignment) -> None:
        run = self.runs.get(assignment)
        if run is None:
            return
        run.fenced = True
        if run.task is not None:
            run.task.cancel()

    async def _generate(self, run: EngineRun) -> None:
        offer = run.offer
        a = offer.assignment
        seed = attempt_seed(offer.sampling.seed, offer.generated_before)
        finish: FinishReason = FinishReason.ERROR
        error: str | None = None
        try:
            stream = self.engine.stream(self.engine_model, offer.prompt, offer.max_new_tokens, offer.sampling, seed)
            async for event in stream:
                if event.tokens:
                    now = self.clock()
                    if not run.generated:
                        self.speeds = self.speeds.with_served(
                            run.waited_tokens, now - run.accepted_at, now, run.in_flight
                        )
                    run.generated.extend(event.tokens)
                    run.token_times.extend([now] * len(event.tokens))
                    self._step(worker_events.TokensProduced(now, a, event.tokens))
                elif event.finish_reason is not None:
                    finish, run.cached_tokens = event.finish_reason, event.cached_tokens
        except asyncio.CancelledError:
            finish = FinishReason.CANCELLED
        except EngineError as exc:
            error = str(exc)
            log.warning("vLLM worker %s: %s failed: %s", self.worker_id, a, exc)
        if run.fenced:
            self._step(worker_events.WorkQuiesced(self.clock(), a))
            return
        if finish is FinishReason.ERROR and error is None:
            error = f"the vLLM engine at {self.engine.url} ended the request with an error"
        self._step(worker_events.WorkFinished(self.clock(), a, finish, self._usage(run), self._timings(run), error))

    # --- accounting ------------------------------------------------------------------

    def _usage(self, run: EngineRun) -> Usage:
        cached = min(run.cached_tokens, len(run.offer.prompt))
        return Usage(
            prompt_tokens=len(run.offer.prompt),
            cached_tokens={"gpu": cached} if cached else {},
            recomputed_tokens=len(run.offer.prompt) - cached,
            generated_tokens=len(run.generated),
        )

    def _timings(self, run: EngineRun) -> Timings:
        times = run.token_times
        return Timings(
            queue_s=max(0.0, run.submitted_at - run.accepted_at),
            prefill_s=(times[0] - run.submitted_at) if times else 0.0,
            ttft_s=(times[0] - run.accepted_at) if times else 0.0,
            inter_token_s=tuple(b - a for a, b in zip(times, times[1:])),
        )
