"""``python -m kvrelay.cli.probed_worker WORKER-ARGS``: ``kvrelay worker WORKER-ARGS`` with a ``WorkerProbe`` attached.

Once the worker's parts are built (``launch.worker.build_worker``) the probe
observes them and prints ``kvrelay probe ready id=<worker id> url=<url>``; see
``kvrelay.bench.worker_probe`` for what it answers. Used by the scenario bench.
"""

from __future__ import annotations

import asyncio
import sys

from kvrelay.bench.worker_probe import WorkerProbe
from kvrelay.cli.main import main as kvrelay_main
from kvrelay.cli.ready import say_ready
from kvrelay.launch import worker as worker_process
from kvrelay.launch.worker_assembly import WorkerParts, WorkerSettings


def main(argv: list[str] | None = None) -> int:
    """Run ``kvrelay worker`` with a probe attached to the parts it builds."""
    build = worker_process.build_worker

    async def build_and_probe(settings: WorkerSettings) -> WorkerParts:
        parts = await build(settings)
        url = WorkerProbe(parts, asyncio.get_running_loop()).start()
        say_ready(f"kvrelay probe ready id={settings.worker_id} url={url}")
        return parts

    worker_process.build_worker = build_and_probe
    args = sys.argv[1:] if argv is None else argv
    return kvrelay_main(["--log-level", "WARNING", "worker", *args])


if __name__ == "__main__":
    sys.exit(main())
