"""The imperative shell around ``core.worker.machine`` that every worker host shares.

``MachineHost`` feeds the machine its events (an offer with the reply that answers its router, a cancel, a
shutdown), sends each message the machine emits through the reply of its assignment (dropped once the
assignment's last word, a ``Result`` or a declined ``OfferResult``, is sent), and carries out the machine's
other effects through four methods each host defines: ``_admit`` (re-check an offer against what the runtime
really has, then step ``AdmissionDecided``), ``_start`` (begin the work), ``_fence`` (stop work whose epoch or
cancel fenced it) and ``_release`` (free what the assignment held). ``quiesced`` is set while the machine holds
no reservation (``launch.worker`` drains on it). The native worker (``worker.host``) and the vLLM worker
(``engines.vllm.host``) differ only in those four effects and in what their heartbeats report; it lives among
the engines because the native runtime is one of them (the layering lets ``worker/`` import ``engines/``,
not the other way).
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import assert_never

from kvrelay.core.worker import events as worker_events
from kvrelay.core.worker import machine
from kvrelay.protocol.messages import Assignment, Cancel, Offer, OfferResult, Residency, Result, Tier, WireMessage

log = logging.getLogger(__name__)

Reply = Callable[[WireMessage], object]
"""Sends one message to the router an assignment came from."""


class MachineHost(ABC):
    """A worker's machine and the effects every host carries out alike (see the module docstring)."""

    def __init__(
        self,
        worker_id: str,
        epoch: int,
        model: str,
        context_limit: int,
        publish: Callable[[WireMessage], object],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.worker_id, self.epoch = worker_id, epoch
        self.model = model
        self.publish = publish
        """Sends a message to every linked router (residency changes, heartbeats)."""
        self.clock = clock
        self._residency_seq = 0
        self.state = machine.new_worker(worker_id, epoch, (model,), context_limit)
        self.quiesced = asyncio.Event()
        self.quiesced.set()
        self._replies: dict[Assignment, Reply] = {}

    def on_offer(self, offer: Offer, reply: Reply) -> None:
        self._replies[offer.assignment] = reply
        self._step(worker_events.OfferReceived(self.clock(), offer))

    def on_cancel(self, cancel: Cancel) -> None:
        self._step(worker_events.CancelReceived(self.clock(), cancel))

    def shut_down(self) -> None:
        """Decline every later offer (``shutting_down``); running work continues."""
        self._step(worker_events.ShutdownRequested(self.clock()))

    def residency(
        self, tier: Tier, stored: tuple[bytes, ...], removed: tuple[bytes, ...] = (), replace: bool = False
    ) -> Residency:
        """The epoch's next residency message for ``tier`` (its sequence number counted here; a new epoch starts
        the count again by setting ``_residency_seq`` to 0)."""
        self._residency_seq += 1
        return Residency(
            worker_id=self.worker_id,
            epoch=self.epoch,
            seq=self._residency_seq,
            tier=tier,
            model=self.model,
            stored=stored,
            removed=removed,
            replace=replace,
        )

    def publish_residency(self, stored: tuple[bytes, ...], removed: tuple[bytes, ...], tier: Tier = "gpu") -> None:
        """One Residency message per change of a tier."""
        self.publish(self.residency(tier, stored, removed))

    @abstractmethod
    def _admit(self, offer: Offer) -> None:
        """Decide ``offer`` against the runtime, then step ``worker_events.AdmissionDecided``."""

    @abstractmethod
    def _start(self, offer: Offer) -> None:
        """Begin the admitted ``offer``'s work."""

    @abstractmethod
    def _fence(self, assignment: Assignment) -> None:
        """Stop ``assignment``'s work: nothing more of it may reach its router."""

    @abstractmethod
    def _release(self, assignment: Assignment) -> None:
        """Free what ``assignment`` held (its reservation ended)."""

    def _step(self, event: worker_events.WorkerEvent) -> None:
        self.state, effects = machine.step(self.state, event)
        for effect in effects:
            match effect:
                case worker_events.SendMessage(message=msg):
                    reply = self._replies.get(msg.assignment)
                    if reply is not None:
                        reply(msg)
                    if isinstance(msg, Result) or (isinstance(msg, OfferResult) and not msg.accepted):
                        self._replies.pop(msg.assignment, None)
                case worker_events.RequestAdmission(offer=offer):
                    self._admit(offer)
                case worker_events.StartWork(offer=offer):
                    self._start(offer)
                case worker_events.FenceWork(assignment=a):
                    self._fence(a)
                case worker_events.ReleaseReservation(assignment=a):
                    self._release(a)
                case _:
                    assert_never(effect)
        if machine.holds_reservations(self.state):
            self.quiesced.clear()
        elif not self.quiesced.is_set():
            counters = self.state.counters
            log.info(
                "worker %s holds no reservations (epoch %d; assignments finished %d, cancelled %d)",
                self.worker_id,
                self.epoch,
                counters.get("finished", 0),
                counters.get("cancelled", 0),
            )
            self.quiesced.set()
