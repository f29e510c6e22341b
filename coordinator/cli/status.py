"""`dp-coordinator status`: ask a running coordinator for its state and print it.

One DEALER connects to the `frontend` address from the coordinator's address
file (without `--addr-file`, the one coordinator vLLM's plugin started on this
host, see `coordinator.cli.common.discover_addr_file`) and sends `QueryState`;
the `StateReply` is printed as tables (group, ranks, counters) or, with
`--json`, as one JSON object. `--watch` repeats the query every `--interval`
seconds until Ctrl-C. Exit code 1, with a message that says what to check, when
the address file is unusable or the coordinator does not answer within
`--timeout`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from coordinator.cli.common import (
    STATE_STYLES,
    StateQuery,
    StatusError,
    add_curve_client_arguments,
    discover_addr_file,
    read_frontend_address,
    shown_state,
)
from coordinator.protocol import frontend as fp
from coordinator.protocol.frontend import group_state_to_builtins

EXIT_OK = 0
EXIT_ERROR = 1
ENGINE_ID_CHARS = 8  # enough to tell incarnations apart; the whole id is in --json


def add_status_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "status",
        help="show the state of a running coordinator",
        description="Ask a running coordinator (over its frontend socket) for membership, "
        "loads, wave and counters, and print them.",
    )
    p.add_argument("--addr-file", default=None, metavar="F",
                   help="the coordinator's address file (default: find the coordinator "
                   "vLLM's plugin started on this host, under VLLM_RPC_BASE_PATH or the "
                   "temporary directory)")
    p.add_argument("--watch", action="store_true", help="keep the view live (Ctrl-C ends)")
    p.add_argument("--interval", type=float, default=1.0, help="refresh period for --watch")
    p.add_argument("--json", action="store_true", help="print the raw state as JSON")
    p.add_argument("--timeout", type=float, default=5.0,
                   help="seconds to wait for the coordinator's answer (default 5)")
    add_curve_client_arguments(p)


def state_tables(state: fp.GroupState) -> Group:
    """The group line, the rank table and the counters.

    The rank table fits 80 columns with the widest values (a state name, five
    digits of load): no value is ever cut; a narrower terminal wraps values
    instead of truncating them.
    """
    mode = "lockstep" if state.lockstep else "dense"
    flag = Text("running", style="green") if state.running else Text("paused", style="yellow")
    header = Text.assemble(
        ("wave ", "bold"), (str(state.wave), "cyan"), " ", flag,
        f"   {mode}   ranks {state.rank_start}..{state.rank_start + state.rank_count - 1}"
        f"   frontends {state.frontends}   in flight {state.in_flight}",
    )
    if state.version:
        header.append(f"   v{state.version}", style="dim")
    if state.shutting_down:
        header.append("   SHUTTING DOWN", style="bold red")
    # No box: two spaces between columns is what lets the widest values fit 80
    # columns. A state name never wraps; the other columns wrap on a narrow screen.
    ranks = Table(title="engines", title_justify="left", box=None, pad_edge=False,
                  header_style="bold")
    for name in ("rank", "state", "engine id", "waiting", "running", "kv", "sent*",
                 "in flight", "last seen"):
        ranks.add_column(name, justify="left" if name in ("state", "engine id") else "right",
                         no_wrap=name == "state", overflow="fold")
    for e in state.engines:
        shown = shown_state(e.state, e.in_flight)
        ranks.add_row(
            str(e.rank), Text(shown, style=STATE_STYLES.get(shown, "bold red")),
            (e.engine_id or "-")[:ENGINE_ID_CHARS],
            str(e.waiting), str(e.running), f"{e.kv_cache_usage:.0%}",
            str(e.dispatched_since_report), str(e.in_flight),
            "-" if e.last_seen_age_s is None else f"{e.last_seen_age_s:.1f}s",
        )
    parts: list[Any] = [header, ranks,
                        Text("sent*: dispatched since the rank's last stats report; "
                             "drained: draining with nothing in flight; last seen: seconds "
                             "since its last traffic", style="dim")]
    versions = version_line(state.engines)
    if versions is not None:
        parts.insert(2, versions)
    if state.counters:
        counters = Table(title="counters", title_justify="left", show_header=False,
                         box=None, pad_edge=False)
        counters.add_column("counter", overflow="fold")
        counters.add_column("value", justify="right", no_wrap=True)
        for key, value in sorted(state.counters.items()):
            counters.add_row(key, str(value))
        parts.append(counters)
    return Group(*parts)


def state_json(state: fp.GroupState) -> str:
    return json.dumps(group_state_to_builtins(state), sort_keys=True)


def run_status(args: argparse.Namespace) -> int:
    console = Console()
    try:
        address = read_frontend_address(args.addr_file or discover_addr_file())
    except StatusError as exc:
        print(f"dp-coordinator status: {exc}", file=sys.stderr, flush=True)
        return EXIT_ERROR
    try:
        query = StateQuery(address, curve_secret_key=args.curve_secret_key,
                           curve_server_key=args.curve_server_key)
    except ValueError as exc:
        print(f"dp-coordinator status: {exc}", file=sys.stderr, flush=True)
        return EXIT_ERROR
    try:
        if not args.watch:
            state = query.query(args.timeout)
            if args.json:
                print(state_json(state), flush=True)
            else:
                console.print(state_tables(state))
            return EXIT_OK
        return _watch(query, args, console)
    except StatusError as exc:
        print(f"dp-coordinator status: {exc}", file=sys.stderr, flush=True)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        query.close()


def _watch(query: StateQuery, args: argparse.Namespace, console: Console) -> int:
    interval = max(0.05, float(args.interval))
    if args.json:
        while True:
            try:
                print(state_json(query.query(args.timeout)), flush=True)
            except StatusError as exc:
                print(json.dumps({"error": str(exc)}), flush=True)
            time.sleep(interval)
    # First answer must come, or the operator has the wrong file.
    state = query.query(args.timeout)
    with Live(state_tables(state), console=console, refresh_per_second=4) as live:
        while True:
            time.sleep(interval)
            try:
                state = query.query(args.timeout)
            except StatusError as exc:
                live.update(Group(state_tables(state), Text(f"{exc}; showing the last answer",
                                                            style="bold red")))
                continue
            live.update(state_tables(state))


def version_line(engines: Sequence[fp.EngineStatus]) -> Text | None:
    """Which vLLM the ranks' greetings named (None: none named one), red if they differ
    or one is outside the supported range."""
    by_version: dict[str, list[int]] = {}
    for e in engines:
        if e.vllm_version is not None:
            by_version.setdefault(e.vllm_version, []).append(e.rank)
    if not by_version:
        return None
    from coordinator.core.ranks.versions import SUPPORTED_RANGE, is_supported

    outside = [v for v in by_version if not is_supported(v)]
    note = (f" ({', '.join(outside)} outside the supported {SUPPORTED_RANGE})"
            if outside else "")
    if len(by_version) == 1:
        return Text(f"vLLM {next(iter(by_version))} on every rank that greeted{note}",
                    style="bold red" if outside else "")
    return Text("vLLM versions differ: " + "; ".join(
        f"{v} on rank {', '.join(map(str, ranks))}" for v, ranks in by_version.items()) + note,
        style="bold red")
