"""The roster keeps workers grouped and in queue order, and pruned planning picks what full planning picks."""

from __future__ import annotations

import random

import pytest

from kvrelay.core.planning import candidates as cand
from kvrelay.core.planning import predicted_ttft
from kvrelay.core.planning.index import ResidencyIndex
from kvrelay.core.planning.roster import Roster, plan_pruned
from kvrelay.protocol.chunk_keys import prompt_chain
from tests.support.router_driver import heartbeat

PROMPT = tuple(range(1, 64 * 12 + 2))
CHAIN = prompt_chain(b"m", PROMPT, 64)


def view(worker_id: str, unheard_s: float = 0.0, **overrides: object) -> predicted_ttft.WorkerView:
    """``unheard_s``: seconds of work the router sent that the heartbeat does not count yet."""
    hb = heartbeat(worker_id, **overrides)
    load = predicted_ttft.WorkerLoad(outstanding_s=unheard_s, unheard_s=unheard_s)
    return predicted_ttft.WorkerView(hb, load, predicted_ttft.reported_fingerprints(hb))


def orders(roster: Roster) -> list[list[str]]:
    return [[wid for _, wid in g.order] for g in roster.groups.values()]


def test_members_are_grouped_by_cost_and_ordered_by_queue() -> None:
    roster = Roster()
    roster.put(view("a", queue_delay_s=0.3))
    roster.put(view("b", queue_delay_s=0.1))
    roster.put(view("c", queue_delay_s=0.2, prefill_s_per_token=5e-3))  # another rate: another group
    assert orders(roster) == [["b", "a"], ["c"]]
    b = view("b", unheard_s=0.5, queue_delay_s=0.1)  # the router sent more since the heartbeat
    roster.put(b)
    assert orders(roster) == [["a", "b"], ["c"]]
    b.load.unheard_released(0.5, None)
    roster.requeue(b)
    assert orders(roster) == [["b", "a"], ["c"]]
    roster.put(view("a", queue_delay_s=0.3, prefill_s_per_token=5e-3))  # a's rates changed: it moves group
    assert orders(roster) == [["b"], ["c", "a"]]
    roster.remove("c")
    roster.remove("a")
    roster.remove("nobody")
    assert orders(roster) == [["b"]] and len(roster) == 1 and roster.view("a") is None


def test_busy_share_follows_queues() -> None:
    roster = Roster()
    assert roster.busy_share() == 0.0
    a, b = view("a"), view("b", queue_delay_s=0.2)
    roster.put(a)
    roster.put(b)
    assert roster.busy_share() == 0.5
    a.load.offered(0.1)
    roster.requeue(a)
    assert roster.busy_share() == 1.0
    roster.remove("b")
    a.load.release_outstanding(0.1)
    a.load.unheard_released(0.1, None)
    roster.requeue(a)
    assert roster.busy_share() == 0.0


def test_work_price_is_the_members_mean_rate() -> None:
    roster = Roster()
    assert roster.work_s_per_token() == 0.0
    for wid in ("a", "b", "c"):
        roster.put(view(wid, prefill_s_per_token=1e-4 / 3))
    assert roster.work_s_per_token() == 1e-4 / 3  # one rate: that rate exactly, not a mean's rounding of it
    roster.put(view("d", prefill_s_per_token=2.5e-4))
    roster.put(view("e", prefill_s_per_token=2.5e-4))
    roster.put(view("a", prefill_s_per_token=1e-4))
    roster.put(view("b", prefill_s_per_token=1e-4))
    roster.put(view("c", prefill_s_per_token=1e-4))
    # three workers at 10,000 tokens/s and two at 4,000: 38,000 / 5 = 7,600 tokens/s per worker
    assert roster.work_s_per_token() == pytest.approx(1 / 7600)
    roster.put(view("f", prefill_s_per_token=0.0))  # a worker that reports no rate yet: no fleet price
    assert roster.work_s_per_token() == 0.0


@pytest.mark.parametrize("seed", range(50))
def test_a_fleet_price_equal_to_the_workers_rate_scores_as_without_one(seed: int) -> None:
    print(f"seed {seed}")
    rng = random.Random(seed)
    hb = heartbeat("w", prefill_s_per_token=rng.choice([1e-4, 2.5e-4, 1e-3 / 3, rng.random() * 1e-3]))
    weight = rng.random() * 2.0
    own = predicted_ttft.score_per_token(hb, predicted_ttft.Scoring(weight))
    priced = predicted_ttft.score_per_token(hb, predicted_ttft.Scoring(weight, work_s_per_token=hb.prefill_s_per_token))
    assert own == priced == hb.prefill_s_per_token * (1.0 + weight)


def random_case(
    rng: random.Random,
) -> tuple[list[predicted_ttft.WorkerView], ResidencyIndex, set[str], set[tuple[str, str]]]:
    n = rng.randrange(1, 12)
    views = []
    for i in range(n):
        views.append(
            view(
                f"w{i:02d}",
                unheard_s=rng.choice([0.0, rng.random()]),
                queue_delay_s=rng.choice([0.0, 0.05, rng.random()]),
                prefill_s_per_token=rng.choice([1e-3, 2e-3]),
                active_lanes=rng.choice([0, 3]),
                prefill_chunk_tokens=rng.choice([0, 64, 256]),
                pages_free=rng.choice([0, 3, 100]),
                pages_evictable=rng.choice([0, 10]),
                models=rng.choice([("m",), ("m",), ("other",)]),
                context_limit=rng.choice([100_000, 100_000, 500]),
                restore_bytes_per_s=rng.choice(
                    [
                        {"ram": 1e9, "ssd": 1e8, "peer": 5e8, "object": 1e8},
                        {"ram": 1e9, "ssd": 1e8, "peer": 5e8, "object": 1e8},
                        {"ram": 2e9, "ssd": 2e8, "peer": 1e7, "object": 1e7},
                    ]
                ),
            )
        )
    index = ResidencyIndex()
    for _ in range(rng.randrange(0, 10)):
        index.store(
            rng.choice(views).heartbeat.worker_id,
            rng.choice(["gpu", "ram", "ssd"]),
            CHAIN[: rng.randrange(1, len(CHAIN) + 1)],
        )
    if rng.random() < 0.5:
        index.store("anyone", "object", CHAIN[: rng.randrange(1, len(CHAIN) + 1)])
    ids = [v.heartbeat.worker_id for v in views]
    excluded = set(rng.sample(ids, rng.randrange(0, 2)))
    pairs = {(rng.choice(ids), rng.choice(["gpu", "ram", "ssd", "peer", "object"])) for _ in range(rng.randrange(0, 3))}
    return views, index, excluded, pairs


@pytest.mark.parametrize("seed", range(300))
def test_pruned_planning_finds_the_same_best_candidate(seed: int) -> None:
    print(f"seed {seed}")
    rng = random.Random(seed)
    views, index, excluded, pairs = random_case(rng)
    roster = Roster()
    for v in views:
        roster.put(v)
    for v in rng.sample(views, len(views) // 2):  # loads move after the views were placed
        v.load.unheard_s = rng.random()
        roster.requeue(v)
    price = rng.choice([0.0, roster.work_s_per_token()])
    scoring = predicted_ttft.Scoring(rng.choice([0.0, 0.5]), rng.random() < 0.5, work_s_per_token=price)
    full = cand.plan("m", len(PROMPT), 16, CHAIN, b"m", 64, views, index, excluded, pairs, 0.0, scoring)
    pruned = plan_pruned("m", len(PROMPT), 16, CHAIN, b"m", 64, roster, index, excluded, pairs, 0.0, scoring)
    assert pruned.best() == full.best()
    planned = {r.worker_id for r in pruned.routes}
    assert planned <= {r.worker_id for r in full.routes}
    best = full.best()
    if best is not None:
        assert all((bound, w) > (best.score_s, best.worker_id) for w, bound in pruned.pruned.items())
        assert not planned & set(pruned.pruned)
        # every worker is planned, pruned, or excluded for a reason
        assert planned | set(pruned.pruned) | set(pruned.excluded) == {v.heartbeat.worker_id for v in views}
