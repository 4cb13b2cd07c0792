"""Consumer cancellation before acceptance, after acceptance (during prefill) and during decode.

Admission takes 10 ms here, so a cancel can reach the worker while it is still
admitting. In every case the consumer gets exactly one ``cancelled`` outcome
holding what it already received, and the worker releases its reservation
only once nothing of the assignment is in flight.
"""

from __future__ import annotations

from kvrelay.sim.interpreter import Simulation
from tests.scenario.scenario_kit import (
    assert_invariants,
    expected_stream,
    request,
    small_cluster,
    tokens,
)


def sim_with(prompt_tokens: int, max_new: int, cancel_at: float) -> Simulation:
    sim = Simulation(small_cluster(), seed=17, admission_s=0.01)
    sim.submit(request("x", tokens(9, prompt_tokens), max_new), at=1.0)
    sim.cancel("x", at=cancel_at)
    return sim


def worker_counters(sim: Simulation) -> dict[str, int]:
    out: dict[str, int] = {}
    for w in sim.workers.values():
        for k, v in w.state.counters.items():
            out[k] = out.get(k, 0) + v
    return out


def test_cancel_before_acceptance() -> None:
    sim = sim_with(640, 8, cancel_at=1.002)  # the offer arrives at ~1.0006, admission ends at ~1.0106
    assert sim.run(until=60.0)
    assert_invariants(sim)
    outcome = sim.consumers["x"].outcomes[0]
    assert outcome.finish_reason == "cancelled" and outcome.tokens == ()
    counters = worker_counters(sim)
    assert counters["cancelled"] == 1 and "accepted" not in counters  # fenced while admitting
    assert sim.records.get("decision") == 1


def test_cancel_after_acceptance_releases_when_the_prefill_step_ends() -> None:
    sim = sim_with(20_000, 8, cancel_at=1.1)  # a 2 s prefill is in flight
    assert sim.run(until=1.2) is False  # not quiescent yet, but the consumer's outcome came at once...
    outcome = sim.consumers["x"].outcomes[0]
    assert outcome.finish_reason == "cancelled" and outcome.tokens == ()
    assert any(w.holds_reservations() for w in sim.workers.values())  # ...the pages wait for the step
    sim2 = sim_with(20_000, 8, cancel_at=1.1)
    assert sim2.run(until=60.0)
    assert_invariants(sim2)
    assert 1.0 + 0.8 < sim2.now < 1.0 + 0.9  # quiescent when the 8192-token prefill chunk ended
    assert worker_counters(sim2)["accepted"] == 1


def test_cancel_during_decode_keeps_what_was_delivered() -> None:
    sim = sim_with(640, 100, cancel_at=1.5)
    assert sim.run(until=60.0)
    assert_invariants(sim)
    c = sim.consumers["x"]
    outcome = c.outcomes[0]
    assert outcome.finish_reason == "cancelled"
    assert 10 < len(outcome.tokens) < 100
    assert list(outcome.tokens) == expected_stream(sim, "x", len(outcome.tokens))
    assert worker_counters(sim)["cancelled"] == 1
