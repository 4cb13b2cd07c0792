"""The real peer routers a trace replay puts in front of the engines, as installed by ``scripts/install_routers.sh``.

- ``Peer.SMG``: SGLang Model Gateway, PyPI ``smg`` 1.13.0, ``smg launch``. Its ``cache_aware`` policy
  (sgl-project/sglang ``sgl-model-gateway/src/policies/cache_aware.rs``) matches the request text against a
  radix tree per worker of what it routed; at a match share of at least ``--cache-threshold`` (0.3 in this
  CLI's help) the request goes to the worker with the longest match, else to the least-loaded worker, and
  when the load is unbalanced (``--balance-abs-threshold``, ``--balance-rel-threshold``) to the least loaded.
- ``Peer.VLLM_ROUTER``: vLLM's router, PyPI ``vllm-router`` 0.1.17 (vllm-project/router, a fork of sgl-router);
  default policy ``cache_aware``, the same approximate radix tree.
- ``Peer.SGLANG_ROUTER``: PyPI ``sglang-router`` 0.3.2, ``sglang-router launch`` (sgl-router before it became
  the gateway): ``cache_aware`` as above.

Contract: ``find_peer(peer, venvs)`` is the executable (``VENVS/<venv>/bin/<exe>``, else on ``PATH``, else None);
``peer_argv(peer, exe, policy, port, metrics_port, urls)`` is its command line on ``127.0.0.1:port`` in front
of ``urls`` with ``policy`` and otherwise its own defaults, logging warnings only, its Prometheus listener on
``127.0.0.1:metrics_port`` (each defaults to port 29000, smg on every address, so two would collide).
"""

from __future__ import annotations

import shutil
from enum import Enum
from pathlib import Path

ROUTERS_VENV = ".venv-routers"
"""Where ``make routers`` (``scripts/install_routers.sh``) installs them, one venv each, in the checkout."""


class Peer(Enum):
    SMG = "smg"
    VLLM_ROUTER = "vllm-router"
    SGLANG_ROUTER = "sglang-router"

    @property
    def executable(self) -> str:
        return self.value

    @property
    def launch_args(self) -> tuple[str, ...]:
        """What comes between the executable and the flags."""
        return () if self is Peer.VLLM_ROUTER else ("launch",)

    @property
    def log_level(self) -> str:
        return "warning" if self is Peer.VLLM_ROUTER else "warn"


def default_venvs() -> Path:
    """``.venv-routers`` at the root of this source tree."""
    return Path(__file__).resolve().parents[4] / ROUTERS_VENV


def find_peer(peer: Peer, venvs: Path | None = None) -> str | None:
    """The peer's executable in its venv under ``venvs`` (default: ``default_venvs()``), else on PATH; None if
    neither has it."""
    candidate = (venvs or default_venvs()) / peer.value / "bin" / peer.executable
    if candidate.is_file():
        return str(candidate)
    return shutil.which(peer.executable)


def peer_argv(
    peer: Peer, executable: str, policy: str, port: int, metrics_port: int, worker_urls: list[str]
) -> list[str]:
    """The peer's command line (see the module contract)."""
    return [
        executable,
        *peer.launch_args,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *worker_urls,
        "--policy",
        policy,
        "--log-level",
        peer.log_level,
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics_port),
    ]
