"""``kvrelay bench``: measured benchmarks with a real model; ``kvrelay bench scenarios`` runs the scenario cases."""

from __future__ import annotations

import argparse

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "scenarios": (
        "kvrelay.cli.bench_scenarios",
        "run a local cluster through cold, resident, partial, ssd, object, cancellation and restart cases",
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    import importlib

    sub = parser.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    for name, (module, help_text) in SUBCOMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        command.set_defaults(_bench_module=module)
        importlib.import_module(module).add_arguments(command)


def run(args: argparse.Namespace) -> int:
    import importlib

    return int(importlib.import_module(args._bench_module).run(args) or 0)
