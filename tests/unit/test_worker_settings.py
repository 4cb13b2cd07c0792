"""A worker's settings become its engine's iteration budgets (``launch.worker_assembly.WorkerSettings``)."""

from __future__ import annotations

import pytest

from kvrelay.launch import defaults
from kvrelay.launch.worker_assembly import WorkerSettings
from kvrelay.worker.runtime.iteration import PolicyConfig


def test_a_served_worker_prefills_alone_in_forwards_of_the_prefill_only_budget() -> None:
    options = WorkerSettings("w").engine_options()
    assert (options.token_budget, options.prefill_only_budget) == (defaults.TOKEN_BUDGET, defaults.PREFILL_ONLY_BUDGET)
    policy = PolicyConfig(options.num_lanes, options.token_budget, options.prefill_only_budget)
    assert policy.budget(0) == defaults.PREFILL_ONLY_BUDGET and policy.budget(1) == defaults.TOKEN_BUDGET


@pytest.mark.parametrize(("token_budget", "prefill_only", "want"), [(4096, 2048, 4096), (512, 0, 0), (512, 1024, 1024)])
def test_the_prefill_only_budget_is_never_below_the_token_budget(
    token_budget: int, prefill_only: int, want: int
) -> None:
    settings = WorkerSettings("w", token_budget=token_budget, prefill_only_budget=prefill_only)
    assert settings.engine_options().prefill_only_budget == want
