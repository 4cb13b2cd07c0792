"""The route bookkeeping of the router endpoint: newest epoch wins, stale connections change nothing."""

from __future__ import annotations

import random

from kvrelay.transport.connections import ConnectionTable, RouteLost


def table_with(*cids: int) -> ConnectionTable:
    table = ConnectionTable()
    for cid in cids:
        table.open(cid)
    return table


def test_first_heartbeat_binds_the_connection_and_its_close_loses_the_route() -> None:
    table = table_with(1)
    assert table.bind_heartbeat(1, "w", 1, 1).accepted
    assert table.route_of("w") == 1
    assert table.close(1) == RouteLost("w", 1)
    assert table.route_of("w") is None


def test_a_newer_epoch_on_another_connection_displaces_the_old_one() -> None:
    table = table_with(1, 2)
    table.bind_heartbeat(1, "w", 1, 5)
    verdict = table.bind_heartbeat(2, "w", 2, 0)
    assert verdict.accepted and verdict.displaced == 1
    assert table.route_of("w") == 2
    # The old connection going away removes nothing.
    assert table.close(1) is None
    assert table.route_of("w") == 2
    assert table.close(2) == RouteLost("w", 2)


def test_a_stale_connection_cannot_take_the_route_back() -> None:
    table = table_with(1, 2)
    table.bind_heartbeat(1, "w", 1, 5)
    table.bind_heartbeat(2, "w", 2, 0)
    refused = table.bind_heartbeat(1, "w", 1, 6)
    assert not refused.accepted and refused.reason == "fenced_epoch"
    assert table.admit(1, "w") == "stale_connection"
    assert table.admit(2, "w") is None
    assert table.route_of("w") == 2


def test_same_epoch_reconnect_replaces_the_route_only_with_a_newer_seq() -> None:
    table = table_with(1, 2, 3)
    table.bind_heartbeat(1, "w", 1, 5)
    replay = table.bind_heartbeat(3, "w", 1, 5)
    assert not replay.accepted and replay.reason == "stale_heartbeat"
    assert table.close(3) is None and table.route_of("w") == 1
    verdict = table.bind_heartbeat(2, "w", 1, 6)
    assert verdict.accepted and verdict.displaced == 1
    assert table.close(1) is None
    assert table.route_of("w") == 2


def test_a_connection_speaks_for_one_worker() -> None:
    table = table_with(1)
    table.bind_heartbeat(1, "a", 1, 1)
    assert table.bind_heartbeat(1, "b", 1, 1).reason == "identity_mismatch"
    assert table.admit(1, "b") == "identity_mismatch"
    assert table.route_of("b") is None


def test_the_epoch_may_grow_on_the_same_connection() -> None:
    table = table_with(1)
    table.bind_heartbeat(1, "w", 1, 9)
    verdict = table.bind_heartbeat(1, "w", 2, 0)
    assert verdict.accepted and verdict.displaced is None
    assert table.admit(1, "w", epoch=1) == "wrong_epoch"
    assert table.admit(1, "w", epoch=2) is None
    assert table.bind_heartbeat(1, "w", 1, 10).reason == "fenced_epoch"


def test_unbound_connections_may_not_speak_for_workers() -> None:
    table = table_with(1)
    assert table.admit(1, "w") == "unbound"
    assert table.close(1) is None


def test_an_ended_epoch_never_comes_back() -> None:
    table = table_with(1, 2)
    table.bind_heartbeat(1, "w", 3, 1)
    table.close(1)
    assert table.bind_heartbeat(2, "w", 3, 2).reason == "fenced_epoch"
    assert table.bind_heartbeat(2, "w", 4, 0).accepted


def test_expiry_ends_the_route_and_its_connection_is_then_stale() -> None:
    table = table_with(1, 2)
    table.bind_heartbeat(1, "w", 2, 1)
    assert table.expire("w", 1) is None
    assert table.expire("w", 2) == 1
    assert table.admit(1, "w") == "stale_connection"
    assert table.close(1) is None
    assert table.bind_heartbeat(2, "w", 2, 2).reason == "fenced_epoch"


def test_random_interleavings_never_let_an_older_epoch_hold_the_route() -> None:
    """Whatever happens, the route holds the newest accepted epoch, and only its holder's close reports a loss."""
    seed = 20261129
    print(f"seed={seed}")
    rng = random.Random(seed)
    for _ in range(200):
        table = ConnectionTable()
        open_ids: list[int] = []
        next_id = 0
        best_epoch = -1
        for _ in range(40):
            action = rng.random()
            if action < 0.3 or not open_ids:
                next_id += 1
                table.open(next_id)
                open_ids.append(next_id)
            elif action < 0.8:
                cid = rng.choice(open_ids)
                epoch, seq = rng.randint(0, 4), rng.randint(0, 6)
                if table.bind_heartbeat(cid, "w", epoch, seq).accepted:
                    assert epoch >= best_epoch
                    best_epoch = epoch
            else:
                cid = open_ids.pop(rng.randrange(len(open_ids)))
                holder = table.route_of("w")
                lost = table.close(cid)
                assert (lost is not None) == (holder == cid)
            route = table.routes.get("w")
            if route is not None:
                assert route.epoch == best_epoch
                assert route.connection_id in open_ids
