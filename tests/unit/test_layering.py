"""The import contract of ``src/kvrelay``: the layering the layout promises, checked on every import.

Rules (each a test below, and each proved to fire on a tree that breaks it):

- ``protocol/`` imports only the standard library, ``msgspec``, ``xxhash`` and itself;
- ``core/`` imports only the standard library, ``msgspec`` (plain data), ``protocol/`` and itself;
- ``models/`` imports neither ``worker/`` nor anything that serves (``launch/``, ``router/``, ``api/``, ``transport/``);
- ``sim/`` imports neither ``worker/``, ``models/`` nor ``launch/`` (it runs without a model);
- ``engines/`` imports neither ``worker/`` (another runtime's host), ``sim/``, nor a serving package
  (``launch/``, ``router/``, ``api/``, ``transport/``): an engine host is driven by the transport, never drives it;
- nothing imports ``cli/`` but ``cli/`` itself.

Every import counts, including those inside functions and under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"


@dataclass(frozen=True)
class Violation:
    """``module`` imports ``target``, which its layer may not."""

    module: str
    target: str
    rule: str


def module_name(path: Path, src: Path) -> str:
    parts = path.relative_to(src).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module name ``path`` imports (absolute imports only; the project uses no relative ones)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import; use the absolute kvrelay.* name"
            assert node.module is not None
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _stdlib(name: str) -> bool:
    return name.split(".")[0] in sys.stdlib_module_names or name == "__future__"


def _allowed_only(prefix: str, extra: tuple[str, ...], rule: str):
    def check(module: str, target: str) -> str | None:
        if not _in(module, prefix) or _stdlib(target):
            return None
        if any(_in(target, ok) for ok in extra):
            return None
        return rule

    return check


def _forbidden(prefix: str, banned: tuple[str, ...], rule: str):
    def check(module: str, target: str) -> str | None:
        if _in(module, prefix) and any(_in(target, bad) for bad in banned):
            return rule
        return None

    return check


def _cli_is_a_leaf(module: str, target: str) -> str | None:
    if _in(target, "kvrelay.cli") and not _in(module, "kvrelay.cli"):
        return "nothing imports kvrelay.cli but kvrelay.cli"
    return None


RULES = (
    _allowed_only(
        "kvrelay.protocol",
        ("kvrelay.protocol", "msgspec", "xxhash"),
        "kvrelay.protocol imports only the standard library, msgspec, xxhash and itself",
    ),
    _allowed_only(
        "kvrelay.core",
        ("kvrelay.protocol", "kvrelay.core", "msgspec"),
        "kvrelay.core imports only the standard library, msgspec, kvrelay.protocol and itself",
    ),
    _forbidden(
        "kvrelay.models",
        ("kvrelay.worker", "kvrelay.launch", "kvrelay.router", "kvrelay.api", "kvrelay.transport", "kvrelay.sim"),
        "kvrelay.models imports no worker, sim or serving package",
    ),
    _forbidden(
        "kvrelay.sim",
        ("kvrelay.worker", "kvrelay.models", "kvrelay.launch", "kvrelay.router", "kvrelay.api", "kvrelay.transport"),
        "kvrelay.sim imports no worker, model, launch or serving package",
    ),
    _forbidden(
        "kvrelay.engines",
        ("kvrelay.worker", "kvrelay.sim", "kvrelay.launch", "kvrelay.router", "kvrelay.api", "kvrelay.transport"),
        "kvrelay.engines imports no worker, sim, launch or serving package",
    ),
    _cli_is_a_leaf,
)


def violations(src: Path) -> list[Violation]:
    """Every import under ``src/kvrelay`` that breaks one of ``RULES``."""
    found = []
    for path in sorted((src / "kvrelay").rglob("*.py")):
        module = module_name(path, src)
        for target in sorted(imports_of(path)):
            for rule in RULES:
                if (broken := rule(module, target)) is not None:
                    found.append(Violation(module, target, broken))
    return found


def test_the_tree_keeps_the_layering() -> None:
    found = violations(SRC)
    assert not found, "\n".join(f"{v.module} imports {v.target}: {v.rule}" for v in found)


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / "kvrelay" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    ("rel", "text", "rule"),
    [
        ("core/router/machine.py", "import torch\n", "kvrelay.core imports only"),
        ("core/planning/index.py", "def f():\n    from kvrelay.store import files\n", "kvrelay.core imports only"),
        ("core/policies/base.py", "from kvrelay.worker.page_pool import PagePool\n", "kvrelay.core imports only"),
        ("protocol/messages.py", "from kvrelay.core.router import events\n", "kvrelay.protocol imports only"),
        ("models/layers.py", "from kvrelay.worker.runtime import jobs\n", "kvrelay.models imports no"),
        ("sim/workers.py", "from kvrelay.launch.child import ChildProcess\n", "kvrelay.sim imports no"),
        ("sim/workers.py", "import kvrelay.worker.page_pool\n", "kvrelay.sim imports no"),
        ("api/app.py", "from kvrelay.cli import serve\n", "nothing imports kvrelay.cli"),
        ("engines/vllm/host.py", "from kvrelay.worker.host import WorkerController\n", "kvrelay.engines imports no"),
    ],
)
def test_a_wrong_import_is_caught(tmp_path: Path, rel: str, text: str, rule: str) -> None:
    found = violations(_tree(tmp_path, {rel: text}))
    assert found and {v.rule[: len(rule)] for v in found} == {rule}, found


def test_allowed_imports_pass(tmp_path: Path) -> None:
    src = _tree(
        tmp_path,
        {
            "core/router/machine.py": (
                "import heapq\nfrom kvrelay.protocol.messages import Offer\nfrom kvrelay.core.planning import index\n"
            ),
            "protocol/messages.py": "import msgspec\n",
            "models/layers.py": "import torch\nfrom kvrelay.models.kernels import attention\n",
            "sim/workers.py": "from kvrelay.core.worker import machine\n",
            "cli/main.py": "from kvrelay.cli import serve\n",
        },
    )
    assert violations(src) == []
