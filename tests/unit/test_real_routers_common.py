"""The real-router report compares setups on their own requests and on the requests every setup answered."""

from __future__ import annotations

from kvrelay.bench.trace.client import Measured
from kvrelay.bench.trace.real_routers_report import Phase, Replay, answered_by_all, figures, markdown


def measured(ttfts: dict[int, float | None]) -> list[Measured]:
    """One replay: request index -> TTFT, None for a request that streamed no text."""
    return [
        Measured(i, 0.1 * i, t, None if t is None else t + 0.1, 100, 16, 0, None if t is not None else "no text")
        for i, t in ttfts.items()
    ]


def phase() -> Phase:
    # kvrelay answers request 3 late (its first text comes after tokens that print nothing); the peer fails it
    kvrelay = {0: 0.020, 1: 0.022, 2: 0.024, 3: 0.300}
    peer = {0: 0.030, 1: 0.032, 2: 0.034, 3: None}
    return Phase(
        "vllm",
        "quiet",
        {
            "kvrelay": [Replay("kvrelay", measured(kvrelay), 0.5, 0.0) for _ in range(2)],
            "smg": [Replay("smg", measured(peer), 0.5, 0.0) for _ in range(2)],
        },
    )


def test_a_request_one_setup_failed_leaves_every_setups_common_figures() -> None:
    common = answered_by_all(phase())
    for runs in common.replays.values():
        assert [[m.index for m in r.measured] for r in runs] == [[0, 1, 2], [0, 1, 2]]


def test_the_verdict_on_common_requests_differs_from_the_one_on_each_setups_own() -> None:
    by_name = {f["name"]: f for f in figures([phase()])}
    own = by_name["vllm_quiet_ttft_p99_s_best_other_over_kvrelay"]["value"]
    common = by_name["vllm_quiet_ttft_p99_s_best_other_over_kvrelay_common"]["value"]
    assert own < 1.0 < common  # kvrelay's late answer to the request the peer failed decides its own p99 only
    report = markdown([phase()], {}, [])
    assert "requests every setup answered" in report
    assert "| 3 a replay |" in report
