"""`dp-coordinator status`: ask a running coordinator for its state and print it.

One DEALER connects to the `frontend` address from the coordinator's address
file and sends `QueryState`; the `StateReply` is printed as tables (group,
ranks, counters) or, with `--json`, as one JSON object. `--watch` repeats the
query every `--interval` seconds until Ctrl-C. Exit code 1, with a message that
says what to check, when the address file is unusable or the coordinator does not
answer within `--timeout`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from typing import Any

import zmq
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from coordinator.engine import CurveClientKeys
from coordinator.frontend import group_state_to_builtins
from coordinator.protocol import frontend as fp
from coordinator.protocol.errors import ProtocolError

EXIT_OK = 0
EXIT_ERROR = 1


class StatusError(Exception):
    """Something the operator must fix; the message says what."""


def read_address_file(path: str) -> str:
    """The coordinator's `frontend` address from its address file."""
    try:
        with open(path, encoding="utf-8") as handle:
            addresses = json.load(handle)
    except FileNotFoundError:
        raise StatusError(f"no address file at {path}: is the coordinator running, and was "
                          "it started with --addr-file pointing there?") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise StatusError(f"cannot read the address file {path}: {exc}") from None
    address = addresses.get("frontend") if isinstance(addresses, dict) else None
    if not isinstance(address, str) or not address:
        raise StatusError(f"the address file {path} has no 'frontend' address")
    return address


class StateQuery:
    """A DEALER to the coordinator's frontend socket, asking for state on demand."""

    def __init__(
        self,
        address: str,
        *,
        curve_secret_key: str | None = None,
        curve_server_key: str | None = None,
    ) -> None:
        self.address = address
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if address.startswith("tcp://["):
            self._sock.setsockopt(zmq.IPV6, 1)
        keys = CurveClientKeys.from_options(curve_secret_key, curve_server_key)
        if keys is not None:
            keys.apply(self._sock, address)
        self._sock.connect(address)
        self._call_ids = itertools.count(1)

    def query(self, timeout_s: float) -> fp.GroupState:
        call_id = next(self._call_ids)
        deadline = time.monotonic() + timeout_s
        try:
            self._sock.send(fp.encode(fp.QueryState(call_id)), zmq.NOBLOCK)
        except zmq.Again:
            raise StatusError(self._silent(timeout_s)) from None
        while True:
            remaining_ms = int(max(0.0, deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0 or not self._sock.poll(remaining_ms, zmq.POLLIN):
                raise StatusError(self._silent(timeout_s))
            frames = self._sock.recv_multipart()
            if len(frames) != 1:
                continue
            try:
                reply = fp.decode_reply(frames[0])
            except ProtocolError:
                continue
            if isinstance(reply, fp.StateReply) and reply.call_id == call_id:
                return reply.state
            if isinstance(reply, fp.ErrorReply) and reply.call_id == call_id:
                raise StatusError(f"the coordinator refused the state query: "
                                  f"{reply.code}: {reply.message}")
            # Anything else is a late answer to an earlier query or a notice.

    def _silent(self, timeout_s: float) -> str:
        return (f"the coordinator at {self.address} did not answer within {timeout_s:g} s "
                "(is it running? is the address file current?)")

    def close(self) -> None:
        self._sock.close(0)
        self._ctx.term()


def state_tables(state: fp.GroupState) -> Group:
    mode = "lockstep" if state.lockstep else "dense"
    flag = Text("running", style="green") if state.running else Text("paused", style="yellow")
    header = Text.assemble(
        ("wave ", "bold"), (str(state.wave), "cyan"), " ", flag,
        f"   {mode}   ranks {state.rank_start}..{state.rank_start + state.rank_count - 1}"
        f"   frontends {state.frontends}   in flight {state.in_flight}",
    )
    if state.shutting_down:
        header.append("   SHUTTING DOWN", style="bold red")
    ranks = Table(title="engines", title_justify="left")
    for name in ("rank", "state", "engine id", "waiting", "running", "kv", "dispatched*",
                 "in flight", "last seen"):
        ranks.add_column(name, justify="left" if name in ("state", "engine id") else "right")
    for e in state.engines:
        style = {"ready": "green", "handshaking": "cyan", "draining": "yellow",
                 "cordoned": "yellow"}.get(e.state, "red")
        ranks.add_row(
            str(e.rank), Text(e.state, style=style), (e.engine_id or "-")[:12],
            str(e.waiting), str(e.running), f"{e.kv_cache_usage:.0%}",
            str(e.dispatched_since_report), str(e.in_flight),
            "-" if e.last_seen_age_s is None else f"{e.last_seen_age_s:.1f} s ago",
        )
    parts: list[Any] = [header, ranks,
                        Text("* dispatched since the rank's last stats report", style="dim")]
    if state.counters:
        counters = Table(title="counters", title_justify="left", show_header=False)
        counters.add_column("counter")
        counters.add_column("value", justify="right")
        for key, value in sorted(state.counters.items()):
            counters.add_row(key, str(value))
        parts.append(counters)
    return Group(*parts)


def state_json(state: fp.GroupState) -> str:
    return json.dumps(group_state_to_builtins(state), sort_keys=True)


def run_status(args: argparse.Namespace) -> int:
    console = Console()
    try:
        address = read_address_file(args.addr_file)
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

