"""Command line entry point: `dp-coordinator` and `python -m coordinator`.

Subcommands:
  serve   run the coordinator process (binds six sockets, writes an address file)
  demo    coordinator + simulated engines + load generator, with a live view
  status  print the state of a running coordinator once, or keep it live
  top     live terminal view of ranks, loads, wave, rates and the watchdog
  keygen  write a CURVE key pair
  cordon, uncordon, drain   operator commands on one rank
  stop    stop the coordinator (--graceful: after the requests in flight)

Each subcommand is a module of this package with its parser and its run
function (`serve`, `demo`, `status`, `top`, `keygen`, `admin`); `common` holds
what the operator tools share.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from coordinator import __version__
from coordinator.cli.admin import add_admin_parsers, run_admin, run_stop
from coordinator.cli.demo import add_demo_parser, run_demo
from coordinator.cli.keygen import add_keygen_parser, run_keygen
from coordinator.cli.serve import add_serve_parser, run_serve
from coordinator.cli.serve_settings import layer_serve_settings
from coordinator.cli.status import add_status_parser, run_status
from coordinator.cli.top import add_top_parser, run_top

__all__ = ["build_parser", "main"]

_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "serve": run_serve,
    "status": run_status,
    "demo": run_demo,
    "top": run_top,
    "keygen": run_keygen,
    "cordon": run_admin,
    "uncordon": run_admin,
    "drain": run_admin,
    "stop": run_stop,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dp-coordinator",
        description="Data-parallel coordinator for LLM engines, wire-compatible with vLLM "
        "0.33: keeps DP ranks in lock-step waves, sends each request to the least-loaded "
        "rank and publishes every rank's load to the frontends.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_serve_parser(sub)
    add_demo_parser(sub)
    add_status_parser(sub)
    add_top_parser(sub)
    add_keygen_parser(sub)
    add_admin_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        # The environment and the --config file lie under the command line.
        args, problems = layer_serve_settings(parser, argv, args)
        args.settings_problems = problems
    run = _COMMANDS.get(args.command)
    if run is None:
        # No default command: serve needs flags, demo runs a load for a while.
        parser.print_help(sys.stderr)
        print("\ndp-coordinator: error: give a COMMAND (try `dp-coordinator demo` for a "
              "simulated group, or `dp-coordinator serve --help`)", file=sys.stderr)
        return 2
    return run(args)
