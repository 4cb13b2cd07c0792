"""Where network namespaces cannot be made, the namespace tests skip and say why (here: not root)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvrelay.testing.netns import unavailable_reason

CHILD = "from kvrelay.testing.netns import unavailable_reason; print(unavailable_reason())"


def test_a_user_without_root_is_told_that_the_namespace_tests_need_root() -> None:
    if os.geteuid() != 0:
        reason = unavailable_reason()
    else:
        if shutil.which("setpriv") is None:
            pytest.skip("setpriv (util-linux) is needed to drop root for this test")
        src = Path(__file__).resolve().parents[2] / "src"
        done = subprocess.run(
            ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable, "-c", CHILD],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(src)},
            cwd="/",
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        reason = done.stdout.strip()
    assert reason is not None and "need root" in reason and ".ci/run" in reason
