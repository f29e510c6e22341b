"""Command line entry point: `dp-coordinator` and `python -m coordinator`.

Subcommands:
  serve   run the coordinator process (binds six sockets, writes an address file)
  demo    coordinator + simulated engines + load generator, with a live view
  status  print the state of a running coordinator once, or keep it live
  top     live terminal view of ranks, loads, wave, rates and the watchdog
  keygen  write a CURVE key pair
  cordon, uncordon, drain   operator commands on one rank
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from coordinator import __version__

SERVE_EPILOG = """\
sockets (keys of the address file):
  handshake      ROUTER  engine HELLO -> INIT -> READY (vLLM-compatible)
  dispatch       ROUTER  requests to engines; the engine's first greeting
  back_output    PULL    engine stats, wave_complete, start_wave
  back_publish   XPUB    READY gate and START_DP_WAVE to engines
  front_publish  XPUB    [counts, wave, running] to frontends
  frontend       ROUTER  this project's frontend protocol (docs/PROTOCOL.md)

Engines identify themselves by their DP rank as two little-endian bytes; other
identities, ranks outside the range, and live ranks claimed by another engine
are refused at the handshake with a message saying how to fix it.
SIGTERM or SIGINT closes the sockets, removes the ipc files and exits 0.
"""


def add_serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        help="run the coordinator process",
        description="Run the DP coordinator: bind its sockets, write the address file, "
        "and keep the engines in step until SIGTERM/SIGINT.",
        epilog=SERVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--engines", type=int, required=True, metavar="N",
                   help="number of DP ranks (engines) in the group")
    p.add_argument("--rank-start", type=int, default=0, metavar="S",
                   help="first global DP rank managed; ranks are S..S+N-1 (default 0)")
    p.add_argument("--frontends", type=int, default=0, metavar="K",
                   help="hold INIT replies until K frontends registered, so every engine "
                   "learns all frontend output addresses (default 0: do not wait)")
    p.add_argument("--host", default=None, metavar="H",
                   help="bind tcp://H:<free port> for every socket instead of private ipc "
                   "paths (default: ipc)")
    p.add_argument("--ipc-dir", default=None, metavar="DIR",
                   help="fixed directory for the ipc sockets, so a restarted coordinator "
                   "binds the same addresses (default: a new private temp directory)")
    p.add_argument("--bind", action="append", default=[], metavar="KEY=ENDPOINT",
                   help="bind one socket at ENDPOINT (ipc://... or tcp://host:port) instead "
                   "of the default, e.g. keep handshake, dispatch and frontend on private "
                   "ipc while the engine-facing back_* sockets use tcp; repeatable")
    p.add_argument("--port-base", type=int, default=None, metavar="P",
                   help="with --host: bind the six sockets on ports P..P+5 (in the order "
                   "of the table below) instead of free ports, so a restarted coordinator "
                   "is found at the same addresses")
    p.add_argument("--state-file", default=None, metavar="F",
                   help="keep registrations, frontends, the gate and the wave in F, and "
                   "resume from it on start: a restarted coordinator then serves the same "
                   "engines (including stock vLLM ones, which never say HELLO again)")
    p.add_argument("--addr-file", default=None, metavar="F",
                   help="write the resolved addresses as JSON to F once all sockets are "
                   "bound (atomically); removed on exit")
    p.add_argument("--no-wave-coordination", action="store_true",
                   help="dense mode: stats and balancing only, no waves (non-MoE models)")
    p.add_argument("--publish-interval-ms", type=float, default=100.0, metavar="MS",
                   help="minimum gap between full state publishes while stats change "
                   "(default 100)")
    p.add_argument("--heartbeat-s", type=float, default=5.0, metavar="S",
                   help="full state publish at least this often when idle (default 5)")
    p.add_argument("--lease-ttl-s", type=float, default=10.0, metavar="S",
                   help="an engine with no traffic for this long is declared dead "
                   "(default 10)")
    p.add_argument("--handshake-timeout-s", type=float, default=1800.0, metavar="S",
                   help="how long an engine may take between HELLO and READY; vLLM loads "
                   "its model there, silently (default 1800)")
    p.add_argument("--policy", default="least-loaded", choices=["least-loaded", "p2c"],
                   help="how submitted requests pick a rank (default least-loaded)")
    p.add_argument("--master-ip", default=None,
                   help="data_parallel_master_ip sent to every engine in INIT "
                   "(default: the advertised host, 127.0.0.1 for ipc)")
    p.add_argument("--master-port", type=int, default=None,
                   help="data_parallel_master_port sent in INIT (default: a free port "
                   "found at start-up)")
    p.add_argument("--coord-store-port", type=int, default=None,
                   help="_coord_store_port sent in INIT (elastic EP; default: not sent)")
    p.add_argument("--vllm-compat", default="0.33", choices=["0.33", "legacy"],
                   help="0.33 (default): vLLM 0.33 frontends. legacy: also accept the pre-0.33 "
                   "frontend wake [engine_index, wave] on front_publish and publish "
                   "2-element count rows for frontends that unpack two")
    p.add_argument("--loop", default="auto", choices=["auto", "uvloop", "asyncio"],
                   help="event loop (default auto: uvloop when installed)")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"], help="default info")
    from coordinator.security import add_curve_arguments
    from coordinator.server.http import add_observability_arguments

    add_observability_arguments(p)
    add_curve_arguments(p)


def add_demo_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo",
        help="run a coordinator with simulated engines under load (the default main job)",
        description="Start a coordinator, N simulated lockstep engines and a load generator "
        "with several frontends; show a live view of every rank, then a summary: requests "
        "completed and lost, waves, balance ratio and first-request wake latency.",
    )
    p.add_argument("--engines", type=int, default=4, metavar="N", help="simulated DP ranks "
                   "(default 4)")
    p.add_argument("--frontends", type=int, default=2, metavar="K",
                   help="frontends generating load (default 2)")
    p.add_argument("--duration", type=float, default=20.0, metavar="S",
                   help="seconds of load (default 20)")
    p.add_argument("--rate", type=float, default=200.0, metavar="R",
                   help="mean request arrivals per second over all frontends, Poisson "
                   "(default 200)")
    p.add_argument("--host", default=None, metavar="H",
                   help="use tcp on H (e.g. 127.0.0.1) instead of ipc")
    p.add_argument("--no-wave-coordination", action="store_true", help="dense mode")
    p.add_argument("--seed", type=int, default=None, help="random seed for the load")
    p.add_argument("--no-live", action="store_true",
                   help="no live terminal view; print only the summary")
    p.add_argument("--json", default=None, metavar="FILE",
                   help="also write the summary as JSON to FILE")


def add_status_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "status",
        help="show the state of a running coordinator",
        description="Ask a running coordinator (over its frontend socket) for membership, "
        "loads, wave and counters, and print them.",
    )
    p.add_argument("--addr-file", required=True, metavar="F",
                   help="the coordinator's address file")
    p.add_argument("--watch", action="store_true", help="keep the view live (Ctrl-C ends)")
    p.add_argument("--interval", type=float, default=1.0, help="refresh period for --watch")
    p.add_argument("--json", action="store_true", help="print the raw state as JSON")
    p.add_argument("--timeout", type=float, default=5.0,
                   help="seconds to wait for the coordinator's answer (default 5)")
    add_curve_client_arguments(p)


def add_curve_client_arguments(p: argparse.ArgumentParser) -> None:
    """Key flags for tools that talk to a coordinator with CURVE on its tcp sockets."""
    p.add_argument("--curve-secret-key", default=None, metavar="FILE",
                   help="this client's secret key file, for a coordinator that requires CURVE")
    p.add_argument("--curve-server-key", default=None, metavar="FILE",
                   help="the coordinator's public key file (NAME.key)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dp-coordinator",
        description="Data-parallel coordinator for LLM engines, wire-compatible with vLLM "
        "0.33: keeps DP ranks in lock-step waves, sends each request to the least-loaded "
        "rank and publishes every rank's load to the frontends.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    from coordinator.security import add_keygen_parser
    from coordinator.top import add_top_parser

    add_serve_parser(sub)
    add_demo_parser(sub)
    add_status_parser(sub)
    add_top_parser(sub)
    add_keygen_parser(sub)
    from coordinator.admin import add_admin_parsers

    add_admin_parsers(sub)
    return parser


def parse_bind_overrides(items: Sequence[str]) -> dict[str, str]:
    overrides: dict[str, str] = {}
    for item in items:
        key, sep, endpoint = item.partition("=")
        if not sep or not key or not endpoint:
            raise SystemExit(f"dp-coordinator serve: error: --bind wants KEY=ENDPOINT, got "
                             f"{item!r}")
        overrides[key] = endpoint
    return overrides


def cmd_serve(args: argparse.Namespace) -> int:
    from coordinator.server.config import ServerConfig
    from coordinator.server.run import configure_logging, run_server

    configure_logging(args.log_level)
    config = ServerConfig(
        engines=args.engines,
        rank_start=args.rank_start,
        frontends=args.frontends,
        host=args.host,
        ipc_dir=args.ipc_dir,
        port_base=args.port_base,
        bind_overrides=parse_bind_overrides(args.bind),
        state_file=args.state_file,
        addr_file=args.addr_file,
        lockstep=not args.no_wave_coordination,
        publish_interval_s=args.publish_interval_ms / 1000.0,
        heartbeat_s=args.heartbeat_s,
        lease_ttl_s=args.lease_ttl_s,
        handshake_timeout_s=args.handshake_timeout_s,
        policy=args.policy,
        master_ip=args.master_ip,
        master_port=args.master_port,
        coord_store_port=args.coord_store_port,
        vllm_compat=args.vllm_compat,
        loop=args.loop,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        watchdog_stall_s=args.watchdog_stall_s,
        watchdog_rewake=args.watchdog_rewake,
        recorder_size=args.recorder_size,
        curve_secret_key=args.curve_secret_key,
        curve_clients_dir=args.curve_clients_dir,
        insecure=args.insecure,
    )
    return run_server(config)


def cmd_status(args: argparse.Namespace) -> int:
    from coordinator.status import run_status

    return run_status(args)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        return cmd_serve(args)
    if args.command == "status":
        return cmd_status(args)
    if args.command == "demo":
        from coordinator.demo import run_demo

        return run_demo(args)
    if args.command == "top":
        from coordinator.top import run_top

        return run_top(args)
    if args.command == "keygen":
        from coordinator.security import run_keygen

        return run_keygen(args)
    if args.command in ("cordon", "uncordon", "drain"):
        from coordinator.admin import run_admin

        return run_admin(args)
    parser.print_help(sys.stderr)
    return 2
