"""The pure iteration policy of the paged runtime (docs/design.md section 8)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay.worker.runtime.iteration import (
    IterationPlan,
    LaneState,
    PolicyConfig,
    PrefillChunk,
    plan_iteration,
)


def decoding(admitted: int, last_step: int = -1) -> LaneState:
    return LaneState(prompt_left=0, admitted=admitted, last_step=last_step)


def prefilling(left: int, admitted: int) -> LaneState:
    return LaneState(prompt_left=left, admitted=admitted)


def test_idle_when_nothing_to_do() -> None:
    plan = plan_iteration(PolicyConfig(num_lanes=4, token_budget=64), [None] * 4, [])
    assert plan == IterationPlan((), (), ())
    assert plan.idle


def test_decode_first_then_prefill_fills_the_remaining_budget() -> None:
    lanes = [decoding(0), None, decoding(1), None]
    plan = plan_iteration(PolicyConfig(num_lanes=4, token_budget=10), lanes, [100, 5])
    assert plan.decode_lanes == (0, 2)
    # the head of the queue takes the lowest free lane and the whole remaining budget
    assert plan.prefill == (PrefillChunk(1, 8),)
    assert plan.admit == (1,)
    assert plan.num_tokens == 10


def test_long_prompt_is_chunked_and_decode_continues_between_chunks() -> None:
    config = PolicyConfig(num_lanes=2, token_budget=16)
    lanes: list[LaneState | None] = [decoding(0), None]
    first = plan_iteration(config, lanes, [40])
    assert first.decode_lanes == (0,) and first.prefill == (PrefillChunk(1, 15),) and first.admit == (1,)
    lanes[1] = prefilling(40 - 15, admitted=1)
    second = plan_iteration(config, lanes, [])
    assert second.decode_lanes == (0,) and second.prefill == (PrefillChunk(1, 15),)
    lanes[1] = prefilling(10, admitted=1)
    third = plan_iteration(config, lanes, [])
    assert third.decode_lanes == (0,) and third.prefill == (PrefillChunk(1, 10),)


def test_several_lanes_keep_one_lane_token_for_waiting_prefill() -> None:
    # budget equals the number of decoders: without the reserve, prefill would starve
    config = PolicyConfig(num_lanes=4, token_budget=3)
    lanes = [decoding(0), decoding(1), prefilling(7, admitted=3), decoding(2)]
    plan = plan_iteration(config, lanes, [])
    assert len(plan.decode_lanes) == 2
    assert plan.prefill == (PrefillChunk(2, 1),)
    # a waiting job that a free lane can admit also counts as waiting prefill work
    lanes2 = [decoding(0), decoding(1), None, decoding(2)]
    plan2 = plan_iteration(config, lanes2, [9])
    assert len(plan2.decode_lanes) == 2 and plan2.admit == (2,) and plan2.prefill == (PrefillChunk(2, 1),)


def test_no_reserve_when_no_prefill_is_waiting() -> None:
    config = PolicyConfig(num_lanes=3, token_budget=3)
    plan = plan_iteration(config, [decoding(0), decoding(1), decoding(2)], [5])  # no free lane
    assert plan.decode_lanes == (0, 1, 2) and plan.prefill == () and plan.admit == ()


def test_short_budget_rotates_decoders_oldest_served_first() -> None:
    config = PolicyConfig(num_lanes=3, token_budget=2)
    lanes = [decoding(0, last_step=5), decoding(1, last_step=3), decoding(2, last_step=4)]
    assert plan_iteration(config, lanes, []).decode_lanes == (1, 2)


def test_single_lane_finishes_decode_before_admitting() -> None:
    config = PolicyConfig(num_lanes=1, token_budget=64)
    busy = plan_iteration(config, [decoding(0)], [10])
    assert busy.decode_lanes == (0,) and busy.admit == () and busy.prefill == ()
    # and takes the full budget for decode (no reserve with one lane)
    free = plan_iteration(config, [None], [10])
    assert free.admit == (0,) and free.prefill == (PrefillChunk(0, 10),)


def test_admission_is_fifo_into_the_lowest_free_lanes() -> None:
    config = PolicyConfig(num_lanes=4, token_budget=100)
    plan = plan_iteration(config, [None, decoding(0), None, None], [10, 20, 30, 40])
    assert plan.admit == (0, 2, 3)
    assert plan.prefill == (PrefillChunk(0, 10), PrefillChunk(2, 20), PrefillChunk(3, 30))


def test_prefilling_lanes_continue_in_admission_order_before_new_admissions() -> None:
    config = PolicyConfig(num_lanes=3, token_budget=12)
    lanes = [prefilling(10, admitted=7), prefilling(10, admitted=3), None]
    plan = plan_iteration(config, lanes, [4])
    assert plan.prefill == (PrefillChunk(1, 10), PrefillChunk(0, 2))
    assert plan.admit == ()
    plan = plan_iteration(config, [prefilling(10, admitted=7), prefilling(12, admitted=3), None], [4])
    assert plan.prefill == (PrefillChunk(1, 12),)


def test_rejects_malformed_input() -> None:
    with pytest.raises(ValueError, match="num_lanes"):
        PolicyConfig(num_lanes=0, token_budget=4)
    with pytest.raises(ValueError, match="token_budget must be at least 2"):
        PolicyConfig(num_lanes=3, token_budget=1)
    with pytest.raises(ValueError, match="expected 2 lanes"):
        plan_iteration(PolicyConfig(num_lanes=2, token_budget=4), [None], [])
    with pytest.raises(ValueError, match="at least one input token"):
        plan_iteration(PolicyConfig(num_lanes=2, token_budget=4), [None, None], [0])
    with pytest.raises(ValueError, match=r"prefill_only_budget must be 0 or at least token_budget \(8\), got 4"):
        PolicyConfig(num_lanes=2, token_budget=8, prefill_only_budget=4)


def test_a_forward_with_no_decoding_lane_takes_the_prefill_only_budget() -> None:
    config = PolicyConfig(num_lanes=4, token_budget=10, prefill_only_budget=40)
    plan = plan_iteration(config, [prefilling(100, 0), None, None, None], [30])
    assert plan.prefill == (PrefillChunk(0, 40),) and plan.num_tokens == 40
    plan = plan_iteration(config, [None] * 4, [25, 15])
    assert plan.prefill == (PrefillChunk(0, 25), PrefillChunk(1, 15))


def test_a_forward_beside_a_decoding_lane_keeps_the_token_budget() -> None:
    config = PolicyConfig(num_lanes=4, token_budget=10, prefill_only_budget=40)
    plan = plan_iteration(config, [prefilling(100, 0), decoding(1), None, None], [])
    assert plan.decode_lanes == (1,) and plan.prefill == (PrefillChunk(0, 9),)


lane_strategy = st.one_of(
    st.none(),
    st.builds(LaneState, prompt_left=st.integers(0, 50), admitted=st.integers(0, 100), last_step=st.integers(-1, 20)),
)


@settings(max_examples=300, deadline=None, derandomize=True)  # deterministic: same examples every run
@given(
    num_lanes=st.integers(1, 6),
    budget=st.integers(1, 40),
    extra=st.sampled_from([None, 0, 1, 25]),
    data=st.data(),
    waiting=st.lists(st.integers(1, 60), max_size=6),
)
def test_plan_invariants(
    num_lanes: int, budget: int, extra: int | None, data: st.DataObject, waiting: list[int]
) -> None:
    lanes = data.draw(st.lists(lane_strategy, min_size=num_lanes, max_size=num_lanes))
    budget = budget if num_lanes == 1 else max(budget, 2)
    prefill_only = 0 if extra is None else budget + extra
    plan = plan_iteration(PolicyConfig(num_lanes, budget, prefill_only), lanes, waiting)
    assert plan.num_tokens <= (budget if plan.decode_lanes else max(budget, prefill_only))
    prefill_lanes = [c.lane for c in plan.prefill]
    assert len(set(prefill_lanes)) == len(prefill_lanes)
    assert not set(prefill_lanes) & set(plan.decode_lanes)
    assert list(plan.decode_lanes) == sorted(plan.decode_lanes)
    for lane in plan.decode_lanes:
        assert lanes[lane] is not None and lanes[lane].decoding
    for lane in plan.admit:
        assert lanes[lane] is None
    assert len(plan.admit) <= len(waiting)
    for chunk in plan.prefill:
        assert chunk.tokens >= 1
        limit = (
            lanes[chunk.lane].prompt_left if lanes[chunk.lane] is not None else waiting[plan.admit.index(chunk.lane)]
        )
        assert chunk.tokens <= limit
    busy_decoders = [i for i, lane in enumerate(lanes) if lane is not None and lane.decoding]
    if num_lanes == 1 and busy_decoders:
        assert plan.admit == ()
    prefill_pending = any(lane is not None and not lane.decoding for lane in lanes) or (
        waiting and None in lanes and not (num_lanes == 1 and busy_decoders)
    )
    if num_lanes > 1 and prefill_pending:
        assert plan.prefill, "several lanes must keep a lane-token for waiting prefill work"
    if not prefill_pending:
        assert len(plan.decode_lanes) == min(len(busy_decoders), budget)


def test_prefilling_lanes_continue_by_their_jobs_place_before_admission_order() -> None:
    """A request that waited for a shared chunk gets its lane after later requests got theirs; its place (when
    the worker accepted it) puts its prefill before theirs, so it is not stuck behind a long prompt that came
    after it (a 23-token follower waited 13 s behind a 1,588-token prompt that arrived 0.4 s later)."""
    config = PolicyConfig(num_lanes=4, token_budget=64)
    later_long = LaneState(prompt_left=1588, admitted=0, place=4.12)
    earlier_short = LaneState(prompt_left=23, admitted=1, place=3.72)
    plan = plan_iteration(config, [later_long, earlier_short, None, None], [])
    assert plan.prefill == (PrefillChunk(1, 23),)  # its first token comes after 23 tokens, not 64
    # Places equal (every job's default): admission order, as before.
    plan = plan_iteration(config, [prefilling(1588, admitted=0), prefilling(23, admitted=1), None, None], [])
    assert plan.prefill == (PrefillChunk(0, 64),)


def test_a_waiting_job_with_an_earlier_place_is_admitted_before_a_prefilling_lane_continues() -> None:
    """A follower that waited for its shared prefix is queued again after a later long prompt got its lane;
    with the budget taken by that prompt it never got a lane of its own, so it waited for the whole prompt
    (a 23-token follower finished with the 1,588-token prompt admitted after it, 5.7 s, in the loaded replays)."""
    config = PolicyConfig(num_lanes=4, token_budget=64)
    later_long = LaneState(prompt_left=1588, admitted=0, place=4.12)
    plan = plan_iteration(config, [later_long, None, None, None], [23, 30], [3.72, 5.0])
    assert plan.admit == (1,) and plan.prefill == (PrefillChunk(1, 23),)
    # Never past the queue's head: a later job with an early place waits behind a head with a late one.
    plan = plan_iteration(config, [later_long, None, None, None], [23, 30], [5.0, 3.72])
    assert plan.admit == () and plan.prefill == (PrefillChunk(0, 64),)
    # Without places (every job's default), as before: the prefilling lane first, then the queue.
    plan = plan_iteration(config, [prefilling(10, admitted=0), None, None, None], [23, 30])
    assert plan.admit == (1, 2) and plan.prefill == (PrefillChunk(0, 10), PrefillChunk(1, 23), PrefillChunk(2, 30))


def test_an_unfinished_chunk_larger_than_the_finishing_ones_does_not_pad_their_forward() -> None:
    """A chunk that does not finish its prompt joins a forward carrying finishing prompts only if it is no
    larger than they are: a follower's first token does not wait for 488 tokens of a longer prompt queued
    after it (a 512-token forward cost it 0.7 s on a two-core CPU); a smaller chunk still rides along."""
    config = PolicyConfig(num_lanes=4, token_budget=512)
    long_prompt = LaneState(prompt_left=1588, admitted=0, place=4.12)
    plan = plan_iteration(config, [decoding(2), long_prompt, None, None], [23, 40], [3.72, 4.5])
    assert plan.decode_lanes == (0,) and plan.admit == (2,) and plan.prefill == (PrefillChunk(2, 23),)
    # Nothing completes: the forward fills its budget as before.
    plan = plan_iteration(config, [decoding(2), long_prompt, None, None], [23], [4.5])
    assert plan.prefill == (PrefillChunk(1, 511),)
    # Later prompts that complete within the budget still ride along; the first that would not ends the forward.
    plan = plan_iteration(config, [None] * 4, [23, 40, 600, 10])
    assert plan.prefill == (PrefillChunk(0, 23), PrefillChunk(1, 40)) and plan.admit == (0, 1)
    # No larger than what the forward carries: it rides (the forward's cost at most doubles).
    plan = plan_iteration(config, [None] * 4, [300, 600])
    assert plan.prefill == (PrefillChunk(0, 300), PrefillChunk(1, 212)) and plan.admit == (0, 1)
