"""The calibration file: it loads, it changes the simulator's costs, and bad files get clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvrelay.bench.trace.prompts import TracePrompt
from kvrelay.bench.trace.simulate import predict_ttft
from kvrelay.cli.main import main as cli_main
from kvrelay.sim.calibration import (
    DEFAULT_CALIBRATION_PATH,
    CalibratedWorkerSpec,
    CalibrationError,
    apply_calibration,
    load_calibration,
    parse_calibration,
    scale_costs,
)
from kvrelay.sim.cluster_config import load_cluster_config
from kvrelay.sim.work import iteration_s


def test_committed_calibration_loads_and_replaces_the_costs() -> None:
    calibration = load_calibration()
    assert DEFAULT_CALIBRATION_PATH.is_file()
    base = load_cluster_config()
    cluster = apply_calibration(base, calibration)
    w = cluster.worker
    assert isinstance(w, CalibratedWorkerSpec)
    assert cluster.workers == calibration.top["workers"] == 2
    assert w.prefill_s_per_token == calibration.worker["prefill_s_per_token"] != base.worker.prefill_s_per_token
    table = calibration.decode_step_table_s
    assert len(table) == w.max_lanes == calibration.worker["max_lanes"]
    assert [w.decode_step(b) for b in range(1, len(table) + 1)] == list(table)
    assert w.decode_step(len(table) + 50) == table[-1]
    assert w.decode_step(0) == table[0]
    assert w.restore_bytes_per_s["ram"] == calibration.worker["restore_bytes_per_s"]["ram"]
    assert w.restore_bytes_per_s["peer"] == base.worker.restore_bytes_per_s["peer"]  # not measured: kept
    assert "date" in calibration.measured and "machine" in calibration.measured


def test_sim_iteration_cost_uses_the_table_and_the_forward_cost() -> None:
    cal = parse_calibration(
        {"worker": {"prefill_s_per_token": 0.001, "prefill_forward_s": 0.05, "decode_step_table_s": [0.1, 0.2, 0.4]}}
    )
    spec = apply_calibration(load_cluster_config(), cal).worker
    assert iteration_s(spec, 0, 100) == pytest.approx(0.05 + 0.1)
    assert iteration_s(spec, 2, 100) == pytest.approx(0.2 + 0.1)
    assert iteration_s(spec, 3, 0) == pytest.approx(0.4)
    assert iteration_s(spec, 0, 0) == 0.0
    plain = load_cluster_config().worker
    assert iteration_s(plain, 2, 100) == pytest.approx(plain.decode_step(2) + 100 * plain.prefill_s_per_token)
    doubled = apply_calibration(load_cluster_config(), scale_costs(cal, 2.0)).worker
    assert iteration_s(doubled, 2, 100) == pytest.approx(2 * iteration_s(spec, 2, 100))


def _prompts() -> list[TracePrompt]:
    shared = tuple(range(1000, 1256))
    return [
        TracePrompt(i, i + 1, 0.05 * i, "", shared + tuple(range(2000 + 64 * i, 2064 + 64 * i)), 4) for i in range(6)
    ]


def test_calibration_changes_the_simulated_ttft() -> None:
    base = load_cluster_config()
    fast = apply_calibration(
        base, parse_calibration({"workers": 2, "worker": {"prefill_s_per_token": 1e-4, "decode_step_table_s": [0.01]}})
    )
    slow = apply_calibration(
        base,
        parse_calibration(
            {
                "workers": 2,
                "worker": {"prefill_s_per_token": 1e-3, "prefill_forward_s": 0.05, "decode_step_table_s": [0.1]},
            }
        ),
    )
    a, b = predict_ttft(_prompts(), fast), predict_ttft(_prompts(), slow)
    assert a.completed == b.completed == 6
    assert b.p50 > 5 * a.p50
    assert a.cached_tokens > 0  # the shared 256-token prefix is served from cache


@pytest.mark.parametrize(
    "document, needle",
    [
        ({"worker": {"prefil_s_per_token": 1.0}}, "prefil_s_per_token"),
        ({"worker": {"decode_step_table_s": [0.1, -1]}}, "decode_step_table_s"),
        ({"worker": {"prefill_forward_s": "fast"}}, "prefill_forward_s"),
        ({"workers": "two"}, "workers"),
        ({"worker": {"restore_bytes_per_s": {"tape": 1.0}}}, "restore_bytes_per_s"),
        ({"network": 3}, "[network]"),
    ],
)
def test_bad_calibration_names_the_key(document: dict, needle: str) -> None:
    with pytest.raises(CalibrationError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        parse_calibration(document, "cal.toml")


def test_missing_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(CalibrationError, match="does not exist"):
        load_calibration(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("workers = = 2\n")
    with pytest.raises(CalibrationError, match="not valid TOML"):
        load_calibration(bad)


def test_sim_cli_loads_a_calibration(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        "".join(
            json.dumps(
                {"timestamp": 100 * i, "input_length": 1024, "output_length": 8, "hash_ids": [0, 1, 10 + i, 20 + i]}
            )
            + "\n"
            for i in range(6)
        )
    )
    out = {}
    for name, extra in (("plain", []), ("calibrated", ["--calibration", str(DEFAULT_CALIBRATION_PATH)])):
        path = tmp_path / f"{name}.json"
        assert cli_main(["sim", "--trace", str(trace), "--block-tokens", "256", "--json", str(path), *extra]) == 0
        out[name] = json.loads(path.read_text())
    assert out["calibrated"]["workers"] == 2 and out["plain"]["workers"] != 2
    p50 = {k: v["policies"]["kvrelay"]["ttft_s"]["p50"] for k, v in out.items()}
    assert p50["calibrated"] > 10 * p50["plain"]  # a CPU worker of Gemma 3 270M against an H100 of an 8B model
    bad = tmp_path / "bad.toml"
    bad.write_text("[worker]\nspeed = 1\n")
    assert cli_main(["sim", "--trace", str(trace), "--block-tokens", "256", "--calibration", str(bad)]) == 2
    assert "unknown key 'speed'" in capsys.readouterr().err
