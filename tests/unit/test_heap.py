"""``launch.heap.freeze_startup_objects``: start-up objects leave the collector's generations (in a child
process, so this test's own heap stays as it is)."""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = """
import gc, json
import kvrelay.launch.router  # a serving process's imports
tracked = len(gc.get_objects())
from kvrelay.launch.heap import freeze_startup_objects
freeze_startup_objects()
after = len(gc.get_objects())
made = [object() for _ in range(10)], {"k": [1]}  # serving allocates: tracked and collected as before
print(json.dumps({"tracked": tracked, "after": after, "frozen": gc.get_freeze_count(), "new": len(gc.get_objects())}))
"""


def test_start_up_objects_leave_the_collectors_generations() -> None:
    out = json.loads(subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True).stdout)
    assert out["tracked"] > 10_000, out  # the imports made objects a full collection would traverse
    assert out["frozen"] >= 0.99 * out["tracked"] and out["after"] < 100, out
    assert out["new"] > out["after"], out  # what is allocated afterwards is still collected
