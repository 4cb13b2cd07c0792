"""The discovery registry: which workers exist, in which epoch, and what they last observed.

Pure data and functions, no clock (``now`` arrives as an argument).

Contract:
- ``accept_heartbeat`` accepts a heartbeat only if its ``(epoch, seq)`` is
  strictly newer than the last accepted one of that worker, and not of an epoch
  already fenced; it reports whether an older epoch was replaced, so the caller
  can fence everything of that epoch.
- ``fence`` marks a worker's epoch unavailable: heartbeats of that epoch or
  older are rejected afterwards; only a newer epoch brings the worker back.
- ``expire`` fences every live worker not heard from for ``expiry_s``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

from kvrelay.protocol.messages import Heartbeat


@dataclass(slots=True)
class WorkerEntry:
    """The registry's view of one worker: its newest accepted heartbeat."""

    heartbeat: Heartbeat
    last_seen: float
    live: bool = True
    fenced_epoch: int = -1

    @property
    def epoch(self) -> int:
        return self.heartbeat.epoch


@dataclass(slots=True)
class Registry:
    workers: dict[str, WorkerEntry] = field(default_factory=dict)
    fenced: dict[str, int] = field(default_factory=dict)
    """Highest fenced epoch per worker, kept even after the entry is gone."""

    def live_entry(self, worker_id: str) -> WorkerEntry | None:
        entry = self.workers.get(worker_id)
        return entry if entry is not None and entry.live else None


class HeartbeatReason(Enum):
    """Why ``accept_heartbeat`` accepted or rejected a heartbeat."""

    NEW_WORKER = "new_worker"
    NEWER = "newer"
    """Accepted: its ``(epoch, seq)`` is newer than the last accepted one."""
    EPOCH_FENCED = "epoch_fenced"
    """Rejected: its epoch (or a newer one) of the worker is fenced."""
    NOT_NEWER = "not_newer"
    """Rejected: its ``(epoch, seq)`` is not newer than the last accepted one."""


class HeartbeatVerdict(NamedTuple):
    reason: HeartbeatReason
    replaced_epoch: int | None = None
    """The older live epoch this heartbeat replaced, if any."""

    @property
    def accepted(self) -> bool:
        return self.reason in (HeartbeatReason.NEW_WORKER, HeartbeatReason.NEWER)


def accept_heartbeat(registry: Registry, hb: Heartbeat, now: float) -> HeartbeatVerdict:
    """Accept ``hb`` if it is newer than anything seen from its worker."""
    if hb.epoch <= registry.fenced.get(hb.worker_id, -1):
        return HeartbeatVerdict(HeartbeatReason.EPOCH_FENCED)
    entry = registry.workers.get(hb.worker_id)
    if entry is None:
        registry.workers[hb.worker_id] = WorkerEntry(hb, now)
        return HeartbeatVerdict(HeartbeatReason.NEW_WORKER)
    old = entry.heartbeat
    if (hb.epoch, hb.seq) <= (old.epoch, old.seq):
        return HeartbeatVerdict(HeartbeatReason.NOT_NEWER)
    replaced = old.epoch if hb.epoch > old.epoch and entry.live else None
    entry.heartbeat = hb
    entry.last_seen = now
    entry.live = True
    return HeartbeatVerdict(HeartbeatReason.NEWER, replaced)


def fence(registry: Registry, worker_id: str, epoch: int) -> bool:
    """Fence ``epoch`` of ``worker_id``; True if a live entry of that epoch (or older) went down."""
    registry.fenced[worker_id] = max(epoch, registry.fenced.get(worker_id, -1))
    entry = registry.workers.get(worker_id)
    if entry is not None and entry.live and entry.epoch <= epoch:
        entry.live = False
        return True
    return False


def credit_pause(registry: Registry, paused_s: float) -> None:
    """Count ``paused_s`` seconds in which the router itself did not run as heard from every live worker: their
    heartbeats of that time wait unread behind the pause, so the silence was the router's, not theirs."""
    for entry in registry.workers.values():
        if entry.live:
            entry.last_seen += paused_s


def expire(registry: Registry, now: float, expiry_s: float) -> list[tuple[str, int]]:
    """Fence every live worker silent for longer than ``expiry_s``; returns ``(worker_id, epoch)`` pairs."""
    expired = [(wid, e.epoch) for wid, e in registry.workers.items() if e.live and now - e.last_seen > expiry_s]
    for wid, epoch in expired:
        fence(registry, wid, epoch)
    return expired
