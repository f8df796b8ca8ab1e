"""The CLI face: `axrl-spike-replay VERB ...`. Each `*_commands` module registers its verbs.

Handlers validate arguments, call one library function and shape its output: a readable summary,
or with `--json` exactly one JSON document on stdout (progress and logs go to stderr).
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import threading

from axrl_spike_replay import __version__
from axrl_spike_replay.cli.output import print_error
from axrl_spike_replay.cli.parameter_names import for_cli
from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.processes.rank_processes import terminate_as_interrupt


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every registered verb."""
    parser = argparse.ArgumentParser(
        prog="axrl-spike-replay",
        description="Find, preserve, read and replay gradient-spike snapshots; run replay-only mitigations.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="VERB")
    sub.required = True
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.endswith("_commands"):
            importlib.import_module(f"{__name__}.{info.name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    if threading.current_thread() is threading.main_thread():
        terminate_as_interrupt()  # SIGTERM stops rank processes and removes temp dirs, as Ctrl-C does
    try:
        status = args.handler(args)
    except AxrlError as exc:
        print_error(args.command, for_cli(str(exc)))  # library messages name parameters neutrally
        return 2
    except KeyboardInterrupt:
        print(f"axrl-spike-replay {args.command}: interrupted", file=sys.stderr)
        return 130
    return int(status or 0)
