"""Measured costs of a real worker, as a calibration file ``kvrelay sim`` overlays on its cluster config.

A calibration file is TOML with the keys of a cluster config (``cluster_config``:
top-level keys, ``[worker]``, ``[worker.restore_bytes_per_s]``, ``[network]``)
plus, in ``[worker]``, ``decode_step_table_s``: the seconds of one decode step at
batch size 1, 2, ... (index ``i`` is ``i + 1`` lanes), ``prefill_forward_s``: the
fixed cost of a forward that only prefills (the intercept of prefill time over
prompt tokens: weights streamed once, the sampled row's logits), and an optional
``[measured]`` table (where and how the figures were measured; free-form,
carried but not used). ``bench/calibrate.py`` writes it.

Contract of ``apply_calibration(cluster, calibration)``: every key the file
sets replaces the cluster's value (restore rates merge per tier); the worker
becomes a ``CalibratedWorkerSpec`` whose ``decode_step(lanes)`` reads the table
(the last entry for larger batches; a flat ``decode_step_s`` when the table is
empty) and whose ``iteration_s`` prices a device iteration as the decode step of
its decoding lanes (or, with none, ``prefill_forward_s``) plus its prefill tokens
at ``prefill_s_per_token``; the result passes ``cluster_config.validate``. An unknown key, a value
of the wrong type or a table that is not positive and non-empty raises
``CalibrationError`` naming the key.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from kvrelay.protocol.messages import RESTORE_TIERS
from kvrelay.sim.cluster_config import (
    ClusterConfig,
    NetworkSpec,
    WorkerSpec,
    validate,
)

DEFAULT_CALIBRATION_PATH = Path(__file__).resolve().parents[3] / "configs" / "calibration-gemma3-270m-cpu.toml"
TABLE_KEY = "decode_step_table_s"
FORWARD_KEY = "prefill_forward_s"


class CalibrationError(ValueError):
    """A calibration file that cannot be used; the message names the file, the key and the fix."""


@dataclass(frozen=True, slots=True)
class CalibratedWorkerSpec(WorkerSpec):
    """A worker spec whose decode step cost comes from a measured per-batch-size table."""

    decode_step_table_s: tuple[float, ...] = ()
    prefill_forward_s: float = 0.0

    def iteration_s(self, decode_lanes: int, prefill_tokens: int) -> float:
        """Seconds of one device iteration with ``decode_lanes`` decoding and ``prefill_tokens`` prompt tokens."""
        if decode_lanes:
            fixed = self.decode_step(decode_lanes)
        else:
            fixed = self.prefill_forward_s if prefill_tokens else 0.0
        return fixed + prefill_tokens * self.prefill_s_per_token

    def decode_step(self, lanes: int) -> float:
        """Seconds of one decode step over ``lanes`` sequences: the table's entry (clamped to its ends)."""
        if not self.decode_step_table_s:
            return WorkerSpec.decode_step(self, lanes)
        return self.decode_step_table_s[min(max(lanes, 1), len(self.decode_step_table_s)) - 1]


@dataclass(frozen=True, slots=True)
class Calibration:
    """The parsed file: overrides per section, the decode table and the provenance table."""

    path: str
    top: dict[str, Any] = field(default_factory=dict)
    worker: dict[str, Any] = field(default_factory=dict)
    network: dict[str, Any] = field(default_factory=dict)
    decode_step_table_s: tuple[float, ...] = ()
    prefill_forward_s: float = 0.0
    measured: dict[str, Any] = field(default_factory=dict)


def _scalars(cls: type, table: dict[str, Any], where: str, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """``table``'s keys checked against ``cls``'s scalar fields and converted to their types."""
    default = cls()
    allowed = {f.name for f in fields(cls)} - {"worker", "network"}
    out: dict[str, Any] = {}
    for key, value in table.items():
        if key in skip:
            continue
        if key not in allowed:
            raise CalibrationError(f"{where}: unknown key {key!r}; allowed: {', '.join(sorted(allowed | set(skip)))}")
        current = getattr(default, key)
        if key == "restore_bytes_per_s":
            if not isinstance(value, dict) or not set(value) <= set(RESTORE_TIERS):
                raise CalibrationError(f"{where}.{key}: a table of tiers {', '.join(RESTORE_TIERS)} to bytes/s")
            out[key] = {k: float(v) for k, v in value.items()}
        elif isinstance(value, bool) != isinstance(current, bool) or not isinstance(value, (type(current), int)):
            raise CalibrationError(f"{where}.{key}: expected {type(current).__name__}, got {value!r}")
        else:
            out[key] = type(current)(value)
    return out


def parse_calibration(document: dict[str, Any], path: str = "calibration") -> Calibration:
    """A ``Calibration`` from a parsed TOML document (see the module contract)."""
    worker = document.get("worker", {})
    network = document.get("network", {})
    measured = document.get("measured", {})
    for name, table in (("worker", worker), ("network", network), ("measured", measured)):
        if not isinstance(table, dict):
            raise CalibrationError(f"{path}: [{name}] must be a table")
    table = worker.get(TABLE_KEY, [])
    if not isinstance(table, list) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in table
    ):
        raise CalibrationError(f"{path}: worker.{TABLE_KEY} must be a list of positive seconds (batch 1, 2, ...)")
    forward = worker.get(FORWARD_KEY, 0.0)
    if not isinstance(forward, (int, float)) or isinstance(forward, bool) or forward < 0:
        raise CalibrationError(f"{path}: worker.{FORWARD_KEY} must be non-negative seconds, got {forward!r}")
    top = {k: v for k, v in document.items() if k not in ("worker", "network", "measured")}
    return Calibration(
        path=path,
        top=_scalars(ClusterConfig, top, path),
        worker=_scalars(WorkerSpec, worker, f"{path}.worker", skip=(TABLE_KEY, FORWARD_KEY)),
        network=_scalars(NetworkSpec, network, f"{path}.network"),
        decode_step_table_s=tuple(float(v) for v in table),
        prefill_forward_s=float(forward),
        measured=dict(measured),
    )


def load_calibration(path: str | Path | None = None) -> Calibration:
    """Read a calibration file (the committed default when ``path`` is None)."""
    p = Path(path) if path is not None else DEFAULT_CALIBRATION_PATH
    try:
        document = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CalibrationError(
            f"calibration file {str(p)!r} does not exist; write one with bench/calibrate.py"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise CalibrationError(f"calibration file {str(p)!r} is not valid TOML: {exc}") from None
    return parse_calibration(document, p.name)


def scale_costs(calibration: Calibration, factor: float) -> Calibration:
    """The calibration with every compute cost (prefill per token and per forward, decode steps) times ``factor``.

    For a run where the workers got a different share of the CPU than while the
    costs were measured: ``factor`` = availability when measured / availability in the run.
    """
    if factor <= 0:
        raise CalibrationError(f"a cost scale must be positive, got {factor}")
    worker = dict(calibration.worker)
    for key in ("prefill_s_per_token", "decode_step_s"):
        if key in worker:
            worker[key] = worker[key] * factor
    return replace(
        calibration,
        worker=worker,
        prefill_forward_s=calibration.prefill_forward_s * factor,
        decode_step_table_s=tuple(v * factor for v in calibration.decode_step_table_s),
    )


def apply_calibration(cluster: ClusterConfig, calibration: Calibration) -> ClusterConfig:
    """``cluster`` with the calibration's figures (see the module contract)."""
    worker_values = dict(calibration.worker)
    if "restore_bytes_per_s" in worker_values:
        worker_values["restore_bytes_per_s"] = {
            **cluster.worker.restore_bytes_per_s,
            **worker_values["restore_bytes_per_s"],
        }
    base = replace(cluster.worker, **worker_values)
    worker = CalibratedWorkerSpec(
        **{f.name: getattr(base, f.name) for f in fields(WorkerSpec)},
        decode_step_table_s=calibration.decode_step_table_s,
        prefill_forward_s=calibration.prefill_forward_s,
    )
    network = replace(cluster.network, **calibration.network)
    try:
        return validate(replace(cluster, **calibration.top, worker=worker, network=network))
    except ValueError as exc:
        raise CalibrationError(f"{calibration.path}: {exc}") from None
