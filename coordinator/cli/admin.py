"""`dp-coordinator cordon | uncordon | drain RANK` and `stop`: operators' commands.

cordon    the rank stays in the wave but gets no new requests
uncordon  it takes requests again
drain     like cordon, and (with --wait) waits until its last request finished
stop      the coordinator stops cleanly (as on SIGTERM); with --graceful it first
          refuses new submits and lets the requests in flight finish

They are the frontend protocol's `admin` message, and they change membership, so
the coordinator takes them only from an operator: by default they go to its
`admin` socket (ipc, owner-only: run them on the coordinator's host as its user),
found through the address file (without `--addr-file`, the one coordinator
vLLM's plugin started on this host, as for `status`); with CURVE keys
(`--curve-secret-key`) they go to the `frontend` socket, where the key must be
listed in the coordinator's `--admin-keys-dir`. The coordinator answers with the
rank's new state or says why it refused.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

from coordinator.cli.common import (
    StateQuery,
    StatusError,
    add_curve_client_arguments,
    discover_addr_file,
    read_frontend_address,
)
from coordinator.protocol import frontend as fp

EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_ERROR = 2


class AdminClient(StateQuery):
    """The state query's DEALER, also sending admin commands."""

    def command(self, command: fp.AdminCommand, rank: int, timeout_s: float) -> fp.AdminDone:
        call_id = next(self._call_ids)
        deadline = time.monotonic() + timeout_s
        self._send(fp.Admin(call_id, command, rank), timeout_s)
        while True:
            reply = self._next_reply(deadline, timeout_s)
            if isinstance(reply, fp.AdminDone) and reply.call_id == call_id:
                return reply
            if isinstance(reply, fp.ErrorReply) and reply.call_id == call_id:
                raise AdminRefused(reply.message)

    def in_flight(self, rank: int, timeout_s: float) -> int:
        for engine in self.query(timeout_s).engines:
            if engine.rank == rank:
                return engine.in_flight
        return 0


class AdminRefused(RuntimeError):
    """The coordinator refused the command; the message says why."""


def add_admin_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    helps = {
        "cordon": "stop sending new requests to a rank (it stays in the wave)",
        "uncordon": "let a cordoned or draining rank take requests again",
        "drain": "cordon a rank and report when its last request finished",
    }
    for command, text in helps.items():
        p = sub.add_parser(command, help=text, description=text[0].upper() + text[1:] + ".")
        p.add_argument("rank", type=int, help="the global DP rank")
        p.add_argument("--addr-file", default=None, metavar="F",
                       help="the coordinator's address file (default: find the coordinator "
                       "vLLM's plugin started on this host, as status and top do)")
        p.add_argument("--timeout", type=float, default=5.0,
                       help="seconds to wait for the coordinator's answer (default 5)")
        if command == "drain":
            p.add_argument("--wait", type=float, default=None, metavar="S",
                           help="wait up to S seconds until the rank has no request in "
                           "flight; exit 1 if it still has some")
        add_curve_client_arguments(p)
    add_stop_parser(sub)


def add_admin_target_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--addr-file", default=None, metavar="F",
                   help="the coordinator's address file (default: find the coordinator "
                   "vLLM's plugin started on this host, as status and top do)")
    p.add_argument("--timeout", type=float, default=5.0,
                   help="seconds to wait for the coordinator's answer (default 5)")
    add_curve_client_arguments(p)


def add_stop_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    text = "stop the coordinator cleanly, as SIGTERM does"
    p = sub.add_parser("stop", help=text, description=text[0].upper() + text[1:] + ".")
    p.add_argument("--graceful", action="store_true",
                   help="first refuse new submits (code shutting_down) and let the "
                   "requests in flight finish, for up to the coordinator's "
                   "--graceful-stop-s (30 s when it has none)")
    p.add_argument("--wait", type=float, default=None, metavar="S",
                   help="wait up to S seconds until the coordinator has exited (its "
                   "address file is gone); exit 1 if it has not")
    add_admin_target_arguments(p)


def check_reachable(address: str) -> None:
    """Say at once why the owner-only admin socket cannot be used, when it cannot
    (ZeroMQ would retry silently until the timeout)."""
    if not address.startswith("ipc://"):
        return
    path = address[len("ipc://"):]
    if not os.path.exists(path):
        raise StatusError(
            f"the admin socket {path} does not exist here: the coordinator stopped, or it "
            "runs with a private /tmp (systemd's PrivateTmp=yes, another container) where "
            "it made the socket; start it with --ipc-dir in a directory both see (the "
            "shipped unit uses its RuntimeDirectory, /run/dp-coordinator) and run this as "
            "its user (sudo -u dp-coordinator dp-coordinator ...)")
    if not os.access(path, os.W_OK):
        raise StatusError(f"the admin socket {path} is owner-only and this user may not use "
                          "it: run the command as the coordinator's user, or over CURVE with "
                          "a key listed in its --admin-keys-dir (--curve-secret-key, "
                          "--curve-server-key)")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(2.0)
        probe.connect(path)
    except ConnectionRefusedError:
        raise StatusError(f"nothing listens on the admin socket {path}: the coordinator "
                          "that made it is gone (its address file is stale)") from None
    except OSError:
        pass  # let ZeroMQ try, and time out with its own message
    finally:
        probe.close()


def run_stop(args: argparse.Namespace) -> int:
    command: fp.AdminCommand = "graceful_stop" if args.graceful else "stop"
    key = "frontend" if args.curve_secret_key is not None else "admin"
    try:
        addr_file = args.addr_file or discover_addr_file()
        address = read_frontend_address(addr_file, key)
        check_reachable(address)
        client = AdminClient(address, curve_secret_key=args.curve_secret_key,
                             curve_server_key=args.curve_server_key)
    except (StatusError, ValueError) as exc:
        print(f"dp-coordinator stop: {exc}", file=sys.stderr, flush=True)
        return EXIT_ERROR
    try:
        client.command(command, 0, args.timeout)
    except AdminRefused as exc:
        print(f"dp-coordinator stop: refused: {exc}", file=sys.stderr, flush=True)
        return EXIT_REFUSED
    except StatusError as exc:
        print(f"dp-coordinator stop: {exc}", file=sys.stderr, flush=True)
        return EXIT_ERROR
    finally:
        client.close()
    print("the coordinator is stopping" + (
        ": new submits are refused while the requests in flight finish" if args.graceful
        else ""), flush=True)
    if args.wait is not None:
        deadline = time.monotonic() + args.wait
        while os.path.exists(addr_file):
            if time.monotonic() >= deadline:
                print(f"the coordinator has not exited after {args.wait} s", file=sys.stderr,
                      flush=True)
                return EXIT_REFUSED
            time.sleep(0.1)
        print("the coordinator has exited", flush=True)
    return EXIT_OK


def run_admin(args: argparse.Namespace) -> int:
    command: fp.AdminCommand = args.command
    # With keys, the frontend socket (tcp, CURVE); without, the owner-only admin socket.
    key = "frontend" if args.curve_secret_key is not None else "admin"
    try:
        address = read_frontend_address(args.addr_file or discover_addr_file(), key)
        check_reachable(address)
        client = AdminClient(address, curve_secret_key=args.curve_secret_key,
                             curve_server_key=args.curve_server_key)
    except (StatusError, ValueError) as exc:
        print(f"dp-coordinator {command}: {exc}", file=sys.stderr, flush=True)
        return EXIT_ERROR
    try:
        done = client.command(command, args.rank, args.timeout)
        print(f"dp_rank={done.rank} is now {done.state}", flush=True)
        wait = getattr(args, "wait", None)
        if command == "drain" and wait is not None:
            deadline = time.monotonic() + wait
            while (left := client.in_flight(args.rank, args.timeout)) > 0:
                if time.monotonic() >= deadline:
                    print(f"dp_rank={args.rank} still has {left} requests in flight after "
                          f"{wait} s", file=sys.stderr, flush=True)
                    return EXIT_REFUSED
                time.sleep(0.2)
            print(f"dp_rank={args.rank} drained: no requests in flight", flush=True)
        return EXIT_OK
    except AdminRefused as exc:
        print(f"dp-coordinator {command}: refused: {exc}", file=sys.stderr, flush=True)
        return EXIT_REFUSED
    except StatusError as exc:
        print(f"dp-coordinator {command}: {exc}", file=sys.stderr, flush=True)
        return EXIT_ERROR
    finally:
        client.close()
