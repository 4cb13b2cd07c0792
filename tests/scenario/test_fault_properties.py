"""Property test over random fault schedules (crashes, restarts, directed partitions, loss, cancels).

Invariants: every request ends with exactly one terminal outcome; no delivered
token comes from a stale attempt; the delivered stream is gapless,
duplicate-free and equal to the deterministic token values (so any prefix is
consistent); a completed request has its whole budget; at quiescence no worker
holds a reservation. Each example prints its schedule and seed.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrelay.sim.interpreter import Simulation
from tests.scenario.scenario_kit import (
    assert_invariants,
    expected_stream,
    request,
    small_cluster,
    tokens,
)

WORKERS = ("w0", "w1", "w2")

crashes = st.lists(
    st.tuples(st.sampled_from(WORKERS), st.floats(0.3, 4.0), st.one_of(st.none(), st.floats(0.1, 3.0))),
    max_size=3,
)
partitions = st.lists(
    st.tuples(st.sampled_from(WORKERS), st.booleans(), st.floats(0.3, 4.0), st.floats(0.05, 4.0)),
    max_size=3,
)
"""(worker, towards the router?, start, duration): one directed link cut for a while."""
requests = st.lists(
    st.tuples(st.integers(0, 2), st.integers(1, 300), st.integers(1, 40), st.floats(0.5, 3.0)),
    min_size=1,
    max_size=5,
)
cancels = st.lists(st.tuples(st.integers(0, 4), st.floats(0.5, 4.0)), max_size=2)


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31 - 1),
    loss=st.sampled_from([0.0, 0.01, 0.1, 0.3]),
    crash_plan=crashes,
    partition_plan=partitions,
    request_plan=requests,
    cancel_plan=cancels,
    admission_s=st.sampled_from([0.0, 0.005]),
)
def test_invariants_hold_under_random_faults(
    seed: int,
    loss: float,
    crash_plan: list,
    partition_plan: list,
    request_plan: list,
    cancel_plan: list,
    admission_s: float,
) -> None:
    print(
        f"seed={seed} loss={loss} admission_s={admission_s} crashes={crash_plan} "
        f"partitions={partition_plan} requests={request_plan} cancels={cancel_plan}"
    )
    sim = Simulation(small_cluster(workers=3, gpu_kv_tokens=8192, loss=loss), seed=seed, admission_s=admission_s)
    for worker_id, at, restart_after in crash_plan:
        sim.crash(worker_id, at=at, restart_after=restart_after)
    for worker_id, to_router, start, duration in partition_plan:
        src, dst = (worker_id, "router") if to_router else ("router", worker_id)
        sim.partition(src, dst, start=start, end=start + duration)
    for i, (prefix, tail, max_new, at) in enumerate(request_plan):
        sim.submit(request(f"r{i}", tokens(prefix, 640) + tokens(100 + i, tail), max_new), at=at)
    for index, at in cancel_plan:
        if index < len(request_plan):
            sim.cancel(f"r{index}", at=at)
    assert sim.run(until=3600.0), "the simulation did not reach quiescence"
    assert_invariants(sim)
    for i, (_, _, max_new, _) in enumerate(request_plan):
        outcome = sim.consumers[f"r{i}"].outcomes[0]
        assert list(outcome.tokens) == expected_stream(sim, f"r{i}", len(outcome.tokens))
        if outcome.finish_reason == "length":
            assert len(outcome.tokens) == max_new
        else:
            assert outcome.finish_reason in ("cancelled", "error") and len(outcome.tokens) <= max_new
