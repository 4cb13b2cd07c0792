"""Which connection carries which worker's route, by epoch (pure bookkeeping, no I/O, no clock).

The router endpoint keeps one ``ConnectionTable``. Connections are named by
integer ids the endpoint assigns. A connection is *bound* to one worker by the
first heartbeat accepted on it; the *route* of a worker (where its offers and
cancels go) is the connection that carried its newest accepted heartbeat.

Contract:
- A heartbeat is accepted only if its ``(epoch, seq)`` is strictly newer than
  every heartbeat accepted for that worker, its epoch is newer than every epoch
  whose route has ended, and the connection is unbound or bound to the same
  worker (a connection speaks for one worker; its epoch may grow). An accepted
  heartbeat moves the route to its connection; the connection that held it
  before is returned as ``displaced`` (the endpoint closes it).
- A route ends only by ``close`` of the connection holding it, or by ``expire``
  of the epoch it carries. Closing any other connection (never bound, bound to
  an older epoch, or displaced by a newer connection) changes no route: a stale
  connection can never remove or replace the route of a newer one.
- ``admit`` lets a worker message through only from the connection that holds
  that worker's route, naming the bound worker (and its epoch, when the message
  carries one).
- Every refusal (of a heartbeat, ``RouteClaim.reason``, or of a message,
  ``admit``'s answer) is an enum whose value is the endpoint's counter name.
- Ended epochs are remembered: heartbeats of an ended epoch are refused, as the
  router's registry refuses them (``core.planning.registry.fence``), so a worker
  whose route ended comes back only with a newer epoch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


@dataclass(frozen=True, slots=True)
class Route:
    connection_id: int
    epoch: int


@dataclass(frozen=True, slots=True)
class Binding:
    worker_id: str
    epoch: int


class ClaimReason(StrEnum):
    """Why a heartbeat's claim on its worker's route was granted or refused; a refusal's value is its counter name."""

    NEW_ROUTE = "new route"
    SAME_CONNECTION = "same connection"
    REPLACED_CONNECTION = "replaced connection"
    IDENTITY_MISMATCH = "identity_mismatch"
    FENCED_EPOCH = "fenced_epoch"
    STALE_HEARTBEAT = "stale_heartbeat"


GRANTED = frozenset({ClaimReason.NEW_ROUTE, ClaimReason.SAME_CONNECTION, ClaimReason.REPLACED_CONNECTION})
"""The reasons of a granted claim: the heartbeat's connection now holds the route."""


class AdmitRefusal(StrEnum):
    """Why ``admit`` stopped a worker message; the value is the endpoint's counter name."""

    UNBOUND = "unbound"
    IDENTITY_MISMATCH = "identity_mismatch"
    STALE_CONNECTION = "stale_connection"
    WRONG_EPOCH = "wrong_epoch"


@dataclass(frozen=True, slots=True)
class RouteClaim:
    """Whether a connection's heartbeat holds its worker's route (``bind_heartbeat``'s answer)."""

    reason: ClaimReason
    displaced: int | None = None
    """The connection that held the route before, when another one."""

    @property
    def accepted(self) -> bool:
        return self.reason in GRANTED


@dataclass(frozen=True, slots=True)
class RouteLost:
    """The route of ``worker_id`` in ``epoch`` ended: the router must be told."""

    worker_id: str
    epoch: int


@dataclass(slots=True)
class ConnectionTable:
    bindings: dict[int, Binding | None] = field(default_factory=dict)
    routes: dict[str, Route] = field(default_factory=dict)
    newest: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Newest accepted ``(epoch, seq)`` per worker, kept after its route ends."""
    ended: dict[str, int] = field(default_factory=dict)
    """Highest epoch per worker whose route ended (closed, expired or replaced)."""

    def open(self, connection_id: int) -> None:
        if connection_id in self.bindings:
            raise ValueError(f"connection {connection_id} is already open")
        self.bindings[connection_id] = None

    def binding(self, connection_id: int) -> Binding | None:
        return self.bindings.get(connection_id)

    def route_of(self, worker_id: str) -> int | None:
        route = self.routes.get(worker_id)
        return route.connection_id if route is not None else None

    def bind_heartbeat(self, connection_id: int, worker_id: str, epoch: int, seq: int) -> RouteClaim:
        if connection_id not in self.bindings:
            raise ValueError(f"connection {connection_id} is not open")
        bound = self.bindings[connection_id]
        if bound is not None and bound.worker_id != worker_id:
            return RouteClaim(ClaimReason.IDENTITY_MISMATCH)
        if epoch <= self.ended.get(worker_id, -1):
            return RouteClaim(ClaimReason.FENCED_EPOCH)
        if (epoch, seq) <= self.newest.get(worker_id, (-1, -1)):
            return RouteClaim(ClaimReason.STALE_HEARTBEAT)
        self.newest[worker_id] = (epoch, seq)
        self.bindings[connection_id] = Binding(worker_id, epoch)
        before = self.routes.get(worker_id)
        self.routes[worker_id] = Route(connection_id, epoch)
        if before is None:
            return RouteClaim(ClaimReason.NEW_ROUTE)
        if before.epoch < epoch:
            self._end(worker_id, before.epoch)
        if before.connection_id == connection_id:
            return RouteClaim(ClaimReason.SAME_CONNECTION)
        return RouteClaim(ClaimReason.REPLACED_CONNECTION, displaced=before.connection_id)

    def admit(self, connection_id: int, worker_id: str, epoch: int | None = None) -> AdmitRefusal | None:
        """``None`` if a message of ``worker_id`` may pass from this connection, else why not."""
        bound = self.bindings.get(connection_id)
        if bound is None:
            return AdmitRefusal.UNBOUND
        if bound.worker_id != worker_id:
            return AdmitRefusal.IDENTITY_MISMATCH
        if self.route_of(worker_id) != connection_id:
            return AdmitRefusal.STALE_CONNECTION
        if epoch is not None and epoch != bound.epoch:
            return AdmitRefusal.WRONG_EPOCH
        return None

    def close(self, connection_id: int) -> RouteLost | None:
        """Forget the connection; the lost route if it held one."""
        bound = self.bindings.pop(connection_id, None)
        if bound is None:
            return None
        route = self.routes.get(bound.worker_id)
        if route is None or route.connection_id != connection_id:
            return None
        del self.routes[bound.worker_id]
        self._end(bound.worker_id, route.epoch)
        return RouteLost(bound.worker_id, route.epoch)

    def expire(self, worker_id: str, epoch: int) -> int | None:
        """End the route of ``worker_id`` if it carries ``epoch`` or older; the connection that held it."""
        route = self.routes.get(worker_id)
        if route is None or route.epoch > epoch:
            return None
        del self.routes[worker_id]
        self._end(worker_id, route.epoch)
        return route.connection_id

    def held_routes(self) -> list[tuple[str, int, int]]:
        """``(worker_id, epoch, connection_id)`` of every route, sorted by worker."""
        return [(w, r.epoch, r.connection_id) for w, r in sorted(self.routes.items())]

    def _end(self, worker_id: str, epoch: int) -> None:
        self.ended[worker_id] = max(epoch, self.ended.get(worker_id, -1))
