"""The simulated cluster's shape and declared costs, loaded from a small TOML file.

``configs/cluster-default.toml`` is the committed default (8 H100 workers serving
a Llama-3-8B-class model); every figure there carries a comment saying where it
comes from. Omitted keys take the defaults below; unknown keys are an error that
names the key and the keys allowed.

``tiers`` names the lower tiers the cluster has (``ram``, ``ssd``, ``peer``,
``object``): a vLLM fleet, say, has device KV and a host-RAM offload per worker
and nothing shared (``tiers = ["ram"]``). ``[[worker_group]]`` tables make a
cluster of workers that differ: each has a ``count`` and a ``[worker_group.worker]``
table of the keys in which its workers differ from ``[worker]``; the first groups'
workers come first, the rest of the ``workers`` take ``[worker]``.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from kvrelay.protocol.chunk_keys import DEFAULT_CHUNK_TOKENS, DEFAULT_PAGE_TOKENS
from kvrelay.protocol.messages import RESTORE_TIERS, Tier

LOWER_TIERS: tuple[Tier, ...] = ("ram", "ssd", "peer", "object")

DEFAULT_CONFIG_PATH = Path(__file__).resolve().parents[3] / "configs" / "cluster-default.toml"


class ClusterConfigError(ValueError):
    """A cluster config that cannot be used; the message names the key and the fix."""


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """Capacities (tokens of KV) and declared costs of one simulated worker."""

    gpu_kv_tokens: int = 400_000
    ram_kv_tokens: int = 4_000_000
    ssd_kv_tokens: int = 30_000_000
    max_lanes: int = 64
    prefill_s_per_token: float = 1e-4
    prefill_chunk_tokens: int = 8192
    decode_step_s: float = 0.025
    decode_step_s_per_lane: float = 0.0
    context_limit: int = 200_000
    restore_bytes_per_s: dict[Tier, float] = field(
        default_factory=lambda: {"ram": 20e9, "ssd": 5e9, "peer": 10e9, "object": 2e9}
    )

    def decode_step(self, lanes: int) -> float:
        """Seconds of one decode step over ``lanes`` sequences."""
        return self.decode_step_s + self.decode_step_s_per_lane * lanes


@dataclass(frozen=True, slots=True)
class NetworkSpec:
    """Per-direction control-message delay, uniform jitter and loss probability."""

    delay_s: float = 0.0005
    jitter_s: float = 0.0002
    loss: float = 0.0


@dataclass(frozen=True, slots=True)
class WorkerGroup:
    """``count`` workers whose spec is ``worker`` (the cluster's, with the group's keys replaced)."""

    count: int = 1
    worker: WorkerSpec = field(default_factory=WorkerSpec)


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    workers: int = 8
    model: str = "llama-3-8b"
    kv_bytes_per_token: int = 131072
    page_tokens: int = DEFAULT_PAGE_TOKENS
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    heartbeat_interval_s: float = 0.5
    object_write_through: bool = True
    worker: WorkerSpec = field(default_factory=WorkerSpec)
    network: NetworkSpec = field(default_factory=NetworkSpec)
    tiers: tuple[Tier, ...] = LOWER_TIERS
    """The lower tiers the cluster has (a subset of ``LOWER_TIERS``)."""
    worker_group: tuple[WorkerGroup, ...] = ()

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_tokens * self.kv_bytes_per_token

    def spec_of(self, index: int) -> WorkerSpec:
        """The spec of the ``index``-th worker (0-based): its group's, else ``worker``."""
        for group in self.worker_group:
            if index < group.count:
                return group.worker
            index -= group.count
        return self.worker

    def rates_of(self, spec: WorkerSpec) -> dict[Tier, float]:
        """The restore rates a worker of ``spec`` has: those of the cluster's tiers."""
        return {t: r for t, r in spec.restore_bytes_per_s.items() if t in self.tiers}

    @property
    def fingerprint(self) -> bytes:
        """The simulated model's fingerprint (it covers ``chunk_tokens``, docs/design.md section 4)."""
        return f"kvrelay-sim:{self.model}:kv{self.kv_bytes_per_token}:chunk{self.chunk_tokens}".encode()


def _build(cls: type, table: dict[str, Any], where: str, base: Any = None) -> Any:
    allowed = {f.name: f for f in fields(cls)}
    unknown = sorted(set(table) - set(allowed))
    if unknown:
        raise ClusterConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}")
    values: dict[str, Any] = {}
    default = base if base is not None else cls()
    for name, value in table.items():
        current = getattr(default, name)
        if name == "worker_group":
            continue  # built last, over the finished [worker]
        if name == "tiers":
            bad = [t for t in value if t not in LOWER_TIERS] if isinstance(value, list) else ["(not a list)"]
            if bad:
                raise ClusterConfigError(f"{where}.tiers: unknown tier(s) {bad}; tiers: {', '.join(LOWER_TIERS)}")
            values[name] = tuple(t for t in LOWER_TIERS if t in value)
        elif isinstance(current, (WorkerSpec, NetworkSpec)):
            if not isinstance(value, dict):
                raise ClusterConfigError(f"{where}: [{name}] must be a table")
            values[name] = _build(type(current), value, f"{where}.{name}")
        elif name == "restore_bytes_per_s":
            bad = sorted(set(value) - set(RESTORE_TIERS)) if isinstance(value, dict) else ["(not a table)"]
            if bad:
                raise ClusterConfigError(
                    f"{where}.{name}: unknown tier(s) {', '.join(bad)}; tiers: {', '.join(RESTORE_TIERS)}"
                )
            values[name] = {**current, **{k: float(v) for k, v in value.items()}}
        elif isinstance(current, bool) != isinstance(value, bool) or not isinstance(value, (type(current), int)):
            raise ClusterConfigError(f"{where}.{name}: expected {type(current).__name__}, got {value!r}")
        else:
            values[name] = type(current)(value)
    built = replace(default, **values)
    groups = table.get("worker_group")
    if groups is not None:
        if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
            raise ClusterConfigError(f"{where}: worker_group must be an array of tables ([[worker_group]])")
        built = replace(built, worker_group=tuple(_group(g, built.worker, f"{where}.worker_group") for g in groups))
    return built


def _group(table: dict[str, Any], worker: WorkerSpec, where: str) -> WorkerGroup:
    unknown = sorted(set(table) - {"count", "worker"})
    if unknown:
        raise ClusterConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: count, worker")
    count = table.get("count")
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ClusterConfigError(f"{where}.count: expected a positive integer, got {count!r}")
    spec = table.get("worker", {})
    if not isinstance(spec, dict):
        raise ClusterConfigError(f"{where}.worker must be a table")
    return WorkerGroup(count, _build(WorkerSpec, spec, f"{where}.worker", base=worker))


def validate(config: ClusterConfig) -> ClusterConfig:
    """Raise ``ClusterConfigError`` unless the figures are usable; return ``config``."""
    w = config.worker
    checks = [
        (config.workers >= 1, "workers must be at least 1"),
        (config.chunk_tokens % config.page_tokens == 0, "chunk_tokens must be a multiple of page_tokens"),
        (w.gpu_kv_tokens >= config.chunk_tokens, "worker.gpu_kv_tokens must hold at least one chunk"),
        (
            w.max_lanes >= 1 and w.prefill_chunk_tokens >= 1,
            "worker.max_lanes and prefill_chunk_tokens must be positive",
        ),
        (all(v > 0 for v in w.restore_bytes_per_s.values()), "restore rates must be positive"),
        (0.0 <= config.network.loss < 1.0, "network.loss must be in [0, 1)"),
        (
            sum(g.count for g in config.worker_group) <= config.workers,
            "the worker groups' counts add up to more than workers",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise ClusterConfigError(f"cluster config: {message}")
    return config


def load_cluster_config(path: str | Path | None = None) -> ClusterConfig:
    """Load a cluster config (the committed default when ``path`` is None)."""
    p = Path(path) if path is not None else DEFAULT_CONFIG_PATH
    try:
        table = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ClusterConfigError(f"cluster config {str(p)!r} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ClusterConfigError(f"cluster config {str(p)!r} is not valid TOML: {exc}") from None
    return validate(_build(ClusterConfig, table, p.name))
