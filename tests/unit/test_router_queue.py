"""The router queue's rules (``core.router.queue``): priority classes, fair shares across users, bounds."""

from __future__ import annotations

import math
import random

import pytest

from kvrelay.core.router.queue import QUEUE_OFF, HoldOrder, Limits, RouterQueue

ROOMY = Limits(max_requests=1000, max_wait_s=math.inf)
FIFO = HoldOrder.of(0.0)


def admit(
    q: RouterQueue,
    rid: str,
    *,
    priority: int = 0,
    user: str = "",
    work: float = 1.0,
    order: HoldOrder | float = 0.0,
) -> None:
    key = order if isinstance(order, HoldOrder) else HoldOrder.of(order)
    assert q.admit(ROOMY, rid, priority, user, work, key, workers=1) is None


def drain(q: RouterQueue) -> list[str]:
    """Take the head until the queue is empty; the order the requests left in."""
    out = []
    while (rid := q.head()) is not None:
        q.take(rid)
        out.append(rid)
    return out


def test_a_lower_priority_number_leaves_first_and_arrival_breaks_ties() -> None:
    q = RouterQueue()
    admit(q, "late-class", priority=5)
    admit(q, "first", priority=-1)
    admit(q, "default-a")
    admit(q, "default-b")
    assert drain(q) == ["first", "default-a", "default-b", "late-class"]


def test_users_of_one_class_take_turns_however_many_each_sent() -> None:
    q = RouterQueue()
    for i in range(6):
        admit(q, f"a{i}", user="alice")
    for i in range(2):
        admit(q, f"b{i}", user="bob")
    assert drain(q) == ["a0", "b0", "a1", "b1", "a2", "a3", "a4", "a5"]


def test_shares_are_of_predicted_work_not_of_requests() -> None:
    q = RouterQueue()
    for i in range(3):
        admit(q, f"big{i}", user="heavy", work=3.0)
    for i in range(6):
        admit(q, f"small{i}", user="light", work=1.0)
    order = drain(q)
    assert order[:5] == ["big0", "small0", "small1", "small2", "big1"]


def test_a_user_arriving_late_gets_no_credit_for_the_time_it_sent_nothing() -> None:
    q = RouterQueue()
    for i in range(8):
        admit(q, f"a{i}", user="alice")
    for _ in range(5):
        head = q.head()
        assert head is not None
        q.take(head)
    for i in range(3):
        admit(q, f"b{i}", user="bob")
    # bob alternates with alice from now on, instead of taking his 5 missed turns in a row
    assert drain(q) == ["b0", "a5", "b1", "a6", "b2", "a7"]


def test_a_users_requests_leave_by_the_policys_order_key() -> None:
    q = RouterQueue()
    admit(q, "k5", order=5.0)
    admit(q, "k1", order=1.0)
    admit(q, "k3", order=3.0)
    assert drain(q) == ["k1", "k3", "k5"]


def test_only_the_head_may_leave() -> None:
    q = RouterQueue()
    admit(q, "a")
    admit(q, "b")
    with pytest.raises(ValueError, match="'b' is not the head"):
        q.take("b")
    with pytest.raises(ValueError, match="'a' is already waiting"):
        admit(q, "a")


def test_the_request_count_bound_refuses_a_new_request_with_a_retry_after() -> None:
    limits = Limits(max_requests=2, max_wait_s=math.inf)
    q = RouterQueue()
    assert q.admit(limits, "a", 0, "", 4.0, FIFO, workers=2) is None
    assert q.admit(limits, "b", 0, "", 4.0, FIFO, workers=2) is None
    refusal = q.admit(limits, "c", 0, "", 4.0, FIFO, workers=2)
    assert refusal is not None and "2 requests are waiting" in refusal.reason
    assert refusal.retry_after_s == 2  # the mean wait per worker of one waiting request
    assert "c" not in q and len(q) == 2


def test_the_work_bound_counts_only_the_classes_that_go_first() -> None:
    limits = Limits(max_requests=100, max_wait_s=10.0)
    q = RouterQueue()
    for i in range(3):  # 0, 5 and 10 s ahead per worker: within the bound
        assert q.admit(limits, f"batch{i}", 9, "", 10.0, FIFO, workers=2) is None
    refusal = q.admit(limits, "more-batch", 9, "", 10.0, FIFO, workers=2)
    assert refusal is not None and "would take 15.0 s" in refusal.reason and refusal.retry_after_s == 5
    assert q.admit(limits, "urgent", 0, "", 10.0, FIFO, workers=2) is None
    assert q.work_ahead(0) == 10.0 and q.work_ahead(9) == 40.0


def test_a_request_that_came_back_goes_first_in_its_flow_whatever_the_bounds() -> None:
    limits = Limits(max_requests=1, max_wait_s=0.0)
    q = RouterQueue()
    assert q.admit(limits, "waiting", 0, "u", 1.0, FIFO, workers=1) is None
    q.requeue("retried", 0, "u", 1.0)
    assert drain(q) == ["retried", "waiting"]


def test_removing_requests_empties_the_queue_and_its_work() -> None:
    q = RouterQueue()
    admit(q, "a", work=0.1)
    admit(q, "b", priority=3, work=0.2)
    admit(q, "c", user="x", work=0.3)
    q.remove("b")
    q.remove("b")  # not waiting any more: a no-op
    assert list(q) == ["a", "c"] and q.work_s == pytest.approx(0.4)
    q.remove("a")
    q.remove("c")
    assert len(q) == 0 and q.work_s == 0.0 and q.work_ahead(3) == 0.0 and q.head() is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"start_within_s": -1.0}, "start bound"),
        ({"max_requests": 0}, "at least 1 request"),
        ({"max_wait_s": math.nan}, "wait bound"),
    ],
)
def test_invalid_limits_name_the_bound(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Limits(**kwargs)


def test_the_queue_off_limits_admit_everything() -> None:
    q = RouterQueue()
    for i in range(100):
        assert q.admit(QUEUE_OFF, f"r{i}", 0, "", 1e6, FIFO, workers=1) is None


def test_random_operations_keep_every_admitted_request_until_it_leaves_once() -> None:
    seed = random.randrange(2**32)
    print(f"seed {seed}")
    rng = random.Random(seed)
    limits = Limits(max_requests=30, max_wait_s=40.0)
    q = RouterQueue()
    waiting: dict[str, int] = {}
    left: list[str] = []
    for i in range(2000):
        op = rng.random()
        if op < 0.05:
            q.long_backlog = not q.long_backlog
        elif op < 0.5:
            rid, priority = f"r{i}", rng.randrange(3)
            work = rng.choice((0.0, 0.5, 2.0))
            full = len(waiting) >= limits.max_requests
            order = HoldOrder(rng.random(), rng.random())
            refusal = q.admit(limits, rid, priority, rng.choice("abc"), work, order, workers=1)
            assert (refusal is not None) >= full, f"seed {seed}"
            if refusal is None:
                waiting[rid] = priority
            else:
                assert refusal.retry_after_s >= 1
        elif op < 0.85 and (head := q.head()) is not None:
            assert waiting[head] == min(waiting.values()), f"seed {seed}: the head is not of the first class"
            q.take(head)
            left.append(head)
            del waiting[head]
        elif waiting:
            gone = rng.choice(sorted(waiting))
            q.remove(gone)
            del waiting[gone]
        assert sorted(q) == sorted(waiting) and len(q) == len(waiting), f"seed {seed}"
    assert len(left) == len(set(left)), f"seed {seed}: a request left twice"


def test_the_long_backlog_order_reorders_every_waiting_request_at_once_and_back() -> None:
    q = RouterQueue()
    for rid, usual, long_backlog in (("old-long", 30.0, 1.0), ("new-short", 6.5, 6.0), ("newer-short", 7.2, 7.0)):
        admit(q, rid, order=HoldOrder(usual, long_backlog))
    assert q.head() == "new-short"
    q.long_backlog = True
    assert q.head() == "old-long"
    q.take("old-long")
    q.long_backlog = False
    assert drain(q) == ["new-short", "newer-short"]


def test_a_request_that_came_back_goes_first_in_either_order() -> None:
    q = RouterQueue()
    admit(q, "a", order=HoldOrder(1.0, 1.0))
    q.requeue("back", 0, "", 1.0)
    for long_backlog in (False, True):
        q.long_backlog = long_backlog
        assert q.head() == "back"


def test_the_order_not_read_sheds_the_requests_that_left_and_keeps_its_order() -> None:
    q = RouterQueue()
    admit(q, "anchor", order=HoldOrder(1e9, 1e9))  # keeps the flow from emptying
    for i in range(500):
        admit(q, f"r{i}", order=HoldOrder(float(i), float(-i)))
        q.take(f"r{i}")  # usual order: each leaves at once, the long-backlog heap keeps its entry
    (flow,) = q._classes[0].flows.values()
    assert len(flow.heaps[1]) <= 2 * len(q) + 65, "stale entries are compacted"
    for i in range(3):
        admit(q, f"s{i}", order=HoldOrder(float(i), float(-i)))
    q.long_backlog = True
    assert drain(q) == ["s2", "s1", "s0", "anchor"]
