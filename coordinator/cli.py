"""Command line entry point: `dp-coordinator` and `python -m coordinator`."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from coordinator import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dp-coordinator",
        description="Data-parallel coordinator for LLM engines (vLLM 0.33 wire-compatible).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    parser.parse_args(argv)
    parser.print_help()
    return 0
