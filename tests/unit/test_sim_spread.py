"""Replays with moved arrivals: the jitter of a trace, the paired comparison over replays, and the bench."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from kvrelay.bench.spread import Run, Stat, compare, summarize
from kvrelay.cli.main import main as cli_main
from kvrelay.sim.trace import TraceRequest, jitter_arrivals
from tests.support.bench_smoke import run_bench

DEV_TRACE = Path(__file__).resolve().parents[2] / "data" / "traces" / "mooncake_synthetic_trace.jsonl"


def requests(n: int, gap_ms: float = 5.0) -> list[TraceRequest]:
    return [TraceRequest(i + 1, i * gap_ms, 100, 4, (i,)) for i in range(n)]


def test_jitter_moves_each_arrival_within_the_bound_and_keeps_every_request() -> None:
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    before = requests(200)
    after = jitter_arrivals(before, 20.0, seed)
    by_line = {r.line: r for r in before}
    assert sorted(r.line for r in after) == [r.line for r in before]
    assert all(abs(r.timestamp_ms - by_line[r.line].timestamp_ms) <= 20.0 for r in after)
    assert all(r.timestamp_ms >= 0.0 for r in after)
    assert [r.timestamp_ms for r in after] == sorted(r.timestamp_ms for r in after)
    assert any(r.timestamp_ms != by_line[r.line].timestamp_ms for r in after)
    assert [r.line for r in after] != [r.line for r in before]  # 5 ms apart, moved by up to 20: some swap
    assert all((r.input_length, r.hash_ids) == (by_line[r.line].input_length, by_line[r.line].hash_ids) for r in after)


def test_jitter_is_a_function_of_the_seed_and_zero_leaves_the_trace_as_it_is() -> None:
    before = requests(50)
    assert jitter_arrivals(before, 10.0, 3) == jitter_arrivals(before, 10.0, 3)
    assert jitter_arrivals(before, 10.0, 3) != jitter_arrivals(before, 10.0, 4)
    assert jitter_arrivals(before, 0.0, 3) == before
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="arrival jitter"):
            jitter_arrivals(before, bad, 0)


def test_sim_cli_moves_arrivals_by_its_seed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p50 = {}
    for jitter in ("0", "300"):
        path = tmp_path / f"j{jitter}.json"
        argv = ["sim", "--trace", str(DEV_TRACE), "--limit", "40", "--arrival-jitter-ms", jitter, "--json", str(path)]
        assert cli_main(argv) == 0
        p50[jitter] = json.loads(path.read_text())["policies"]["kvrelay"]["ttft_s"]["p50"]
    assert "arrivals moved within +-300 ms" in capsys.readouterr().out
    assert p50["0"] != p50["300"]
    assert cli_main(["sim", "--trace", str(DEV_TRACE), "--limit", "5", "--arrival-jitter-ms", "-2"]) == 2
    assert "arrival jitter must be" in capsys.readouterr().err


def runs(table: dict[str, list[tuple[float, float]]]) -> list[Run]:
    return [Run(p, i, mean, p99, 10) for p, figs in table.items() for i, (mean, p99) in enumerate(figs)]


def test_the_paired_ratio_compares_within_each_replay() -> None:
    table = {
        "kvrelay": [(1.0, 10.0), (2.0, 12.0), (1.0, 8.0)],
        "a": [(1.1, 9.0), (1.8, 15.0), (1.2, 9.0)],
        "b": [(1.5, 11.0), (2.4, 11.0), (0.9, 16.0)],
    }
    c = summarize(runs(table), "kvrelay")
    mean, p99 = c[Stat.MEAN], c[Stat.P99]
    assert mean.best_peer == "a"  # medians: a 1.2, b 1.5
    assert [mean.ratio.least, mean.ratio.median, mean.ratio.largest] == pytest.approx([0.9, 0.9, 1.1])
    assert mean.wins == 1  # only replay 0: 1.0 against 1.1 and 1.5
    assert p99.best_peer == "a" and p99.by_policy["a"].median == 9.0  # b: 11, 11, 16 -> median 11
    assert [p99.ratio.least, p99.ratio.median, p99.ratio.largest] == pytest.approx([0.9, 11 / 12, 9 / 8])
    assert p99.wins == 1 and p99.replays == 3


def test_a_replay_missing_a_policy_is_refused() -> None:
    table = runs({"kvrelay": [(1.0, 2.0), (1.0, 2.0)], "a": [(1.0, 2.0)]})
    with pytest.raises(ValueError, match="replays \\[1\\] lack"):
        compare(table, "kvrelay", Stat.MEAN)
    with pytest.raises(ValueError, match="at least one peer"):
        compare(runs({"kvrelay": [(1.0, 2.0)]}), "kvrelay", Stat.MEAN)


def test_sim_spread_bench_smoke(tmp_path: Path) -> None:
    """bench/sim_spread.py runs on a slice of the dev trace and writes every figure (values not asserted)."""
    args = ["--limit", "60", "--replays", "2", "--configs", "default", "--rates", "1", "--policies", "kvrelay,mooncake"]
    code, figures = run_bench("sim_spread.py", args, tmp_path / "figures.json")
    assert code == 0
    names = {f["name"] for f in figures}
    assert {"default_x1_mean_ratio_median", "default_x1_p99_kvrelay_lowest_replays"} <= names
    assert all(set(f) == {"name", "value", "unit", "baseline", "baseline_value"} for f in figures)
    assert (tmp_path / "figures.png").stat().st_size > 0
