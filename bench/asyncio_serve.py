"""`dp-coordinator` with uvloop switched off, for the uvloop on/off comparison.

    python -m bench.asyncio_serve serve --engines 8 ...

Used only when `dp-coordinator serve` has no `--loop` flag of its own: it
replaces the server's event-loop runner with plain `asyncio.run` and then runs
the unchanged command line.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Coroutine
from typing import Any


def _run_plain(main: Coroutine[Any, Any, int], loop: str = "asyncio") -> int:
    return asyncio.run(main)


def main() -> int:
    import coordinator.server.run as server_run
    from coordinator.cli import main as cli_main

    server_run.run_loop = _run_plain  # type: ignore[assignment]
    return cli_main(sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
