"""What one simulated iteration takes (``take_prefills``) and the deltas a sequence yields (``delta_of``)."""

from __future__ import annotations

from kvrelay.core.worker import events as worker_events
from kvrelay.protocol.messages import Assignment, Offer
from kvrelay.sim.admission import AdmissionPlan
from kvrelay.sim.cache import SharedObjectTier, WorkerCaches
from kvrelay.sim.iteration import delta_of, enqueue, take_prefills
from kvrelay.sim.tokens import token_value
from kvrelay.sim.work import Work, WorkerStats


def work(request_id: str, prompt_len: int, accepted_at: float = 0.0, max_new: int = 8, priority: int = 0) -> Work:
    offer = Offer(
        assignment=Assignment(request_id, 1),
        worker_id="w0",
        epoch=1,
        model="m",
        prompt=tuple(range(prompt_len)),
        max_new_tokens=max_new,
        priority=priority,
    )
    plan = AdmissionPlan((), (), (), {}, prompt_len, 1, 0.0, {})
    return Work(offer, plan, 1, [], accepted_at, prompt_len)


def caches() -> WorkerCaches:
    return WorkerCaches(1000, 4, 0, 0, SharedObjectTier(), False)


def test_an_iteration_takes_prefills_in_order_up_to_its_budget_and_lanes() -> None:
    queue: list[Work] = []
    for w in (work("a", 300), work("b", 100), work("c", 300)):
        enqueue(queue, w)
    taken = take_prefills(
        queue, lanes=2, budget=500, now=1.0, caches=caches(), filling=None, chunk_tokens=64, stats=WorkerStats()
    )
    assert [(w.offer.assignment.request_id, n) for w, n in taken] == [("a", 300), ("b", 100)]
    assert [w.prefill_started_at for w in queue] == [1.0, 1.0, None]  # c has no lane: it waits, unstarted
    again = take_prefills(
        queue, lanes=2, budget=500, now=2.0, caches=caches(), filling=None, chunk_tokens=64, stats=WorkerStats()
    )
    assert [w.offer.assignment.request_id for w, _ in again] == ["a", "b"]  # started ones keep their lanes


def test_an_unfinished_chunk_larger_than_the_finishing_ones_waits_for_the_next_iteration() -> None:
    """As the live runtime (``plan_iteration``): a chunk that does not finish its prefill joins an iteration
    carrying finishing prefills only if it is no larger than they are; otherwise it starts in the next one."""

    def taken(sizes: tuple[int, ...]) -> list[tuple[str, int]]:
        queue: list[Work] = []
        for i, n in enumerate(sizes):
            enqueue(queue, work(f"w{i}", n))
        got = take_prefills(
            queue, lanes=2, budget=400, now=1.0, caches=caches(), filling=None, chunk_tokens=64, stats=WorkerStats()
        )
        return [(w.offer.assignment.request_id, n) for w, n in got]

    assert taken((100, 1000)) == [("w0", 100)]  # 300 unfinished tokens after 100 finishing ones
    assert taken((300, 1000)) == [("w0", 300), ("w1", 100)]  # 100 after 300: it rides
    assert taken((1000,)) == [("w0", 400)]  # nothing finishes: the whole budget


def test_a_waiting_prefill_of_lower_priority_value_goes_first_but_never_passes_a_started_one() -> None:
    queue: list[Work] = []
    enqueue(queue, work("long", 1000, priority=5))
    take_prefills(
        queue, lanes=4, budget=64, now=0.0, caches=caches(), filling=None, chunk_tokens=64, stats=WorkerStats()
    )
    enqueue(queue, work("late", 100, accepted_at=1.0, priority=9))
    enqueue(queue, work("short", 100, accepted_at=2.0, priority=1))
    assert [w.offer.assignment.request_id for w in queue] == ["long", "short", "late"]


def test_deltas_go_out_at_the_first_token_every_delta_tokens_and_at_the_last() -> None:
    w = work("a", 10, max_new=5)
    sent: list[tuple[int, ...]] = []
    for generated in range(1, 6):
        w.generated = generated
        delta = delta_of(float(generated), w, delta_tokens=3)
        if delta is not None:
            assert isinstance(delta, worker_events.TokensProduced) and delta.assignment == w.offer.assignment
            sent.append(delta.tokens)
    seed = w.offer.sampling.seed
    assert sent == [
        (token_value(seed, 10),),
        tuple(token_value(seed, 10 + i) for i in range(1, 4)),
        (token_value(seed, 14),),
    ]
