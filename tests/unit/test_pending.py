"""Predict on route: pending credits in the index, and the router that credits, plans with and ends them."""

from __future__ import annotations

from kvrelay.core.planning.index import GPU, PENDING, ResidencyIndex
from kvrelay.core.planning.pending import PendingCredits
from kvrelay.core.planning.routes import PENDING_SOURCE, is_pending, offered_route, walk_route
from kvrelay.core.router.events import Record, Tick
from kvrelay.core.router.machine import RouterConfig
from kvrelay.protocol.chunk_keys import prompt_chain
from kvrelay.protocol.messages import RouteSegment
from tests.support.router_driver import Driver, heartbeat, offers


def keys(n: int, tag: bytes = b"k") -> list[bytes]:
    return [tag + i.to_bytes(15, "little") for i in range(n)]


def mark(ix: ResidencyIndex, worker: str, key: bytes) -> int:
    shift = ix.shift_of(worker)
    assert shift is not None
    return (ix.value(key) >> shift) & (GPU | PENDING)


def test_a_credit_marks_what_is_not_on_the_device_and_ends_with_its_request() -> None:
    ix = ResidencyIndex()
    ks = keys(4)
    ix.store("w0", "gpu", ks[:1])
    credits = PendingCredits(ix)
    assert credits.credit("w0", "r1", ks, deadline=10.0) == 3
    assert [mark(ix, "w0", k) for k in ks] == [GPU, PENDING, PENDING, PENDING]
    assert credits.credit("w0", "r2", ks[:2], deadline=10.0) == 1  # shares k1 with r1
    credits.release("r1")
    assert [mark(ix, "w0", k) for k in ks] == [GPU, PENDING, 0, 0]
    credits.release("r2")
    assert [mark(ix, "w0", k) for k in ks] == [GPU, 0, 0, 0] and len(credits) == 0


def test_the_first_priority_of_a_key_is_the_lowest_of_the_credits_holding_it_on_that_worker() -> None:
    ix = ResidencyIndex()
    ks = keys(3)
    credits = PendingCredits(ix)
    credits.credit("w0", "late", ks, deadline=10.0, priority=9.0)
    credits.credit("w0", "early", ks[:2], deadline=10.0, priority=4.0)
    credits.credit("w1", "elsewhere", ks, deadline=10.0, priority=1.0)
    assert credits.first_priority("w0", ks[1]) == 4.0  # "early" computes it first on w0
    assert credits.first_priority("w0", ks[2]) == 9.0  # only "late" holds it there
    credits.release("late")
    assert credits.first_priority("w0", ks[2]) is None


def test_stored_keys_settle_and_a_new_credit_replaces_the_old() -> None:
    ix = ResidencyIndex()
    ks = keys(3)
    credits = PendingCredits(ix)
    credits.credit("w0", "r", ks, deadline=10.0)
    ix.store("w0", "gpu", ks[:2])
    credits.settle("w0", ks[:2])
    assert [mark(ix, "w0", k) for k in ks] == [GPU, GPU, PENDING] and len(credits) == 1
    credits.credit("w1", "r", ks, deadline=10.0)  # re-routed: the credit moves
    assert mark(ix, "w0", ks[2]) == 0 and all(mark(ix, "w1", k) == PENDING for k in ks)


def test_credits_expire_at_their_deadline_and_die_with_their_worker() -> None:
    ix = ResidencyIndex()
    ks = keys(2)
    credits = PendingCredits(ix)
    credits.credit("w0", "early", ks[:1], deadline=5.0)
    credits.credit("w0", "late", ks[1:], deadline=9.0)
    assert credits.expire(4.9) == 0
    assert credits.expire(5.0) == 1
    assert mark(ix, "w0", ks[0]) == 0 and mark(ix, "w0", ks[1]) == PENDING
    ix.drop_worker("w0")
    credits.drop_worker("w0")
    assert len(credits) == 0 and credits.expire(100.0) == 0


def test_the_bound_keeps_a_chains_leading_keys() -> None:
    ix = ResidencyIndex()
    ks = keys(5)
    credits = PendingCredits(ix, max_keys=3)
    assert credits.credit("w0", "r", ks, deadline=1.0) == 3
    assert [mark(ix, "w0", k) for k in ks] == [PENDING] * 3 + [0, 0]
    assert credits.truncated == 1 and len(credits) == 3


def test_a_route_ends_where_pending_chunks_end_and_the_offer_stops_before_them() -> None:
    ix = ResidencyIndex()
    ks = keys(4)
    ix.store("w0", "gpu", ks[:1])
    ix.store("w0", "pending", ks[1:3])
    ix.store("w0", "ram", ks[3:])
    shift = ix.shift_of("w0")
    route = walk_route(ix.runs(ks), ix, shift, GPU | PENDING | 6, True, True)
    assert route == (RouteSegment("gpu", 1), RouteSegment("gpu", 2, PENDING_SOURCE))
    assert is_pending(route[1]) and offered_route(route) == route[:1]
    blind = walk_route(ix.runs(ks), ix, shift, GPU | 6, True, True)  # a policy that does not predict
    assert blind == (RouteSegment("gpu", 1),)


PROMPT = tuple(range(1, 64 * 8 + 2))  # 8 routable chunks
FOLLOWER = PROMPT + tuple(range(1000, 1064))  # the same 8 chunks, then one more


def _pair(policy: str) -> tuple[Driver, str, str]:
    """A leader routed to an idle worker, then a follower sharing its prefix before any residency arrives."""
    d = Driver(RouterConfig(), policy)
    d.message(heartbeat("w0"))
    d.message(heartbeat("w1"))
    (leader,) = offers(d.request("lead", PROMPT, max_new=4))
    d.accept(leader)
    (follower,) = offers(d.request("follow", FOLLOWER, max_new=4))
    return d, leader.worker_id, follower.worker_id


def test_a_follower_goes_where_its_prefix_is_being_computed() -> None:
    d, lead_worker, follow_worker = _pair("kvrelay")
    assert follow_worker == lead_worker
    (offer,) = [e for e in offers(d.effects) if e.offer.assignment.request_id == "follow"]
    assert offer.offer.route == () and offer.offer.chain == ()  # the worker is offered no pending chunk
    (decision,) = [e for e in d.effects if isinstance(e, Record) and e.kind == "decision" and e.request_id == "follow"]
    chosen = decision.data["chosen"]
    assert [s.source for s in chosen.route] == [PENDING_SOURCE] and chosen.cached_tokens == 8 * 64


def test_a_policy_that_does_not_predict_spreads_the_follower() -> None:
    _, lead_worker, follow_worker = _pair("mooncake")
    assert follow_worker != lead_worker


def test_the_router_settles_on_residency_releases_at_the_end_and_expires_on_ticks() -> None:
    d, w, _ = _pair("kvrelay")
    chain = prompt_chain(b"m", FOLLOWER, 64)
    assert len(d.state.pending) == 9
    d.residency(w, "gpu", chain[:8], seq=1)
    assert len(d.state.pending) == 1  # the follower's own last chunk
    (follow,) = [e for e in offers(d.effects) if e.offer.assignment.request_id == "follow"]
    d.accept(follow)
    d.result(follow.offer.assignment, w, (1, 2, 3, 4))
    assert len(d.state.pending) == 0
    (lead,) = [e for e in offers(d.effects) if e.offer.assignment.request_id == "lead"]
    d.result(lead.offer.assignment, w, (1, 2, 3, 4))
    d2, _, _ = _pair("kvrelay")
    d2.feed(Tick(1000.0))
    assert len(d2.state.pending) == 0 and d2.state.counters["pending_expired"] == 2
