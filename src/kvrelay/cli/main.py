"""The ``kvrelay`` command: one subcommand per face (docs/design.md section 10).

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; this module only dispatches, importing the chosen module
lazily so ``kvrelay sim`` never loads torch. Before any command loads torch it sets
``OMP_WAIT_POLICY=PASSIVE`` unless the environment sets a policy (``OMP_DEFAULTS``).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from kvrelay.launch.child import follow_parent

OMP_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}
"""OpenMP settings every command takes unless its environment sets them; libgomp reads them once, when torch
loads. Passive: a thread of torch's team that has no work sleeps instead of spinning, so on a machine with
more runnable threads than cores it gives its core to the thread the team waits for, and to the server's
event loop (why and how fast: docs/performance.md, "OpenMP wait policy")."""

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("kvrelay.cli.serve", "serve the OpenAI-compatible API with a router and one worker in one process"),
    "sim": ("kvrelay.cli.sim", "replay a Mooncake-format trace through the router under logical time"),
    "explain": ("kvrelay.cli.explain", "print the recorded candidates, winner, losers and outcome of one request"),
    "generate": ("kvrelay.cli.generate", "continue a prompt with a local model through the paged runtime"),
    "router": ("kvrelay.cli.router", "run the HTTP ingress and router; workers connect over WebSocket"),
    "worker": ("kvrelay.cli.worker", "run one worker that serves a model for one or several routers"),
    "cluster": ("kvrelay.cli.cluster", "run a router and N worker processes on this machine"),
    "bench": ("kvrelay.cli.bench", "measured benchmarks with a real model: kvrelay bench scenarios"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvrelay", description=__doc__.splitlines()[0].replace("``", ""))
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        command.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(command)
    return parser


def main(argv: list[str] | None = None) -> int:
    for name, value in OMP_DEFAULTS.items():
        os.environ.setdefault(name, value)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    follow_parent()
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
