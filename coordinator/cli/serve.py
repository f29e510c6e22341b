"""`dp-coordinator serve`: the coordinator process, and every flag it takes."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from coordinator._zmq import LOOP_CHOICES
from coordinator.cli.serve_settings import CONFIG_ENV, ENV_PREFIX
from coordinator.core.ranks.versions import SUPPORTED_RANGE
from coordinator.server.config import ServerConfig
from coordinator.server.http import add_observability_arguments

DEFAULTS = ServerConfig(engines=1)
"""Every default below is read from here (the rules' from ``CoreConfig``), never repeated."""

SERVE_EPILOG = """\
sockets (keys of the address file):
  handshake      ROUTER  engine HELLO -> INIT -> READY (vLLM-compatible)
  dispatch       ROUTER  requests to engines; the engine's first greeting
  back_output    PULL    engine stats, wave_complete, start_wave
  back_publish   XPUB    READY gate and START_DP_WAVE to engines
  front_publish  XPUB    [counts, wave, running] to frontends
  frontend       ROUTER  this project's frontend protocol (docs/PROTOCOL.md)
  admin          ROUTER  operators' commands; ipc, owner-only, in a private directory

Engines identify themselves by their DP rank as two little-endian bytes; other
identities, ranks outside the range, and live ranks claimed by another engine
are refused at the handshake with a message saying how to fix it.
SIGTERM or SIGINT closes the sockets, removes the ipc files and exits 0 (with
--graceful-stop-s, after the requests in flight finished).
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
    p.add_argument("--engines", type=int, default=None, metavar="N",
                   help="number of DP ranks (engines) in the group (required: here, in "
                   "the --config file or in DP_COORDINATOR_ENGINES)")
    p.add_argument("--rank-start", type=int, default=DEFAULTS.rank_start, metavar="S",
                   help="first global DP rank managed; ranks are S..S+N-1 (default 0)")
    p.add_argument("--frontends", type=int, default=DEFAULTS.frontends, metavar="K",
                   help="hold INIT replies until K frontends registered, so every engine "
                   "learns all frontend output addresses (default 0: do not wait)")
    p.add_argument("--host", default=None, metavar="H",
                   help="bind tcp://H:<free port> for every socket instead of private ipc "
                   "paths (default: ipc)")
    p.add_argument("--ipc-dir", default=None, metavar="DIR",
                   help="fixed directory for the ipc sockets, so a restarted coordinator "
                   "binds the same addresses, and for the owner-only admin socket "
                   "(DIR/admin.d/admin, with --host too), so operators find it where "
                   "the service's /tmp is private (default: a new private temp directory)")
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
    p.add_argument("--publish-interval-ms", type=float,
                   default=DEFAULTS.publish_interval_s * 1000.0, metavar="MS",
                   help="minimum gap between full state publishes while stats change "
                   "(default 100)")
    p.add_argument("--heartbeat-s", type=float, default=DEFAULTS.heartbeat_s, metavar="S",
                   help="full state publish at least this often when idle (default 5)")
    p.add_argument("--lease-ttl-s", type=float, default=DEFAULTS.lease_ttl_s, metavar="S",
                   help="an engine from which nothing arrived for this long (traffic, or "
                   "heartbeat answers on tcp) is declared dead; probes, pings and silence "
                   "bounds scale with it (docs/OPERATIONS.md; default 10)")
    p.add_argument("--handshake-timeout-s", type=float,
                   default=DEFAULTS.handshake_timeout_s, metavar="S",
                   help="how long an engine may take between HELLO and READY; vLLM loads "
                   "its model there, silently (default 1800)")
    p.add_argument("--policy", default=DEFAULTS.policy, choices=["least-loaded", "p2c", "prefix"],
                   help="how submitted requests pick a rank (default least-loaded): "
                   "least-loaded scans every rank's load; p2c compares two at random; prefix "
                   "weighs each rank's load in tokens against the prompt tokens it has "
                   "cached, from the engines' KV cache events (see --kv-events-endpoint)")
    add_prefix_arguments(p)
    p.add_argument("--frontend-lease-ttl-s", type=float,
                   default=DEFAULTS.frontend_lease_ttl_s, metavar="S",
                   help="a frontend registration with no message or heartbeat for this long "
                   "expires, freeing its slot (the SDK heartbeats every S/3) (default 30)")
    p.add_argument("--min-engines", type=int, default=DEFAULTS.min_engines, metavar="N",
                   help="fewest ranks a SCALE_ELASTIC_EP may leave (default: --engines, so "
                   "the group size is fixed); smaller requests are refused and counted")
    p.add_argument("--max-engines", type=int, default=DEFAULTS.max_engines, metavar="N",
                   help="most ranks a SCALE_ELASTIC_EP may ask for (default: --engines); for "
                   "elastic EP give vLLM's --elastic-ep-max-dp-size")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULTS.max_request_bytes, metavar="B",
                   help="bound on one message on the frontend socket, all frames together "
                   "(a submit with its payload); larger ones are refused with too_large "
                   "(default 16 MiB)")
    p.add_argument("--max-engine-message-bytes", type=int,
                   default=DEFAULTS.max_engine_message_bytes, metavar="B",
                   help="bound on one message from an engine (handshake, dispatch, "
                   "back_output), all frames together; larger ones are dropped and counted "
                   "(default 1 MiB)")
    p.add_argument("--master-ip", default=None,
                   help="data_parallel_master_ip sent to every engine in INIT "
                   "(default: the advertised host, 127.0.0.1 for ipc)")
    p.add_argument("--master-port", type=int, default=None,
                   help="data_parallel_master_port sent in INIT (default: a free port "
                   "found at start-up on the advertised host; with --master-ip, give it "
                   "too, since 0 is sent otherwise)")
    p.add_argument("--coord-store-port", type=int, default=None,
                   help="_coord_store_port sent in INIT (elastic EP; default: not sent)")
    p.add_argument("--vllm-compat", default=DEFAULTS.vllm_compat, choices=["0.33", "legacy"],
                   help="count rows: 0.33 (default) publishes [waiting, running, "
                   "kv_cache_usage], which every vLLM from 0.29 to 0.33 unpacks; legacy "
                   "publishes 2-element rows for frontends from before kv_cache_usage, and "
                   "honours their wake (as the default does)")
    p.add_argument("--frontend-wake", default="honour" if DEFAULTS.frontend_wake else "ignore",
                   choices=["honour", "ignore"],
                   help="the pre-0.33 first-request wake [engine, wave] on front_publish: "
                   "honour (default; vLLM 0.29-0.32 MoE groups hang without it) or ignore "
                   "(drop and count it, as vLLM 0.33's coordinator does)")
    p.add_argument("--require-supported-vllm", action="store_true",
                   help="cordon engines whose greeting names a vLLM outside the supported "
                   f"range ({SUPPORTED_RANGE}): they stay in the wave but get no requests "
                   "(uncordon overrides); by default they are used and logged once")
    p.add_argument("--graceful-stop-s", type=float, default=DEFAULTS.graceful_stop_s,
                   metavar="S",
                   help="on SIGTERM/SIGINT, first refuse new submits (code shutting_down) "
                   "and wait up to S seconds until no request is in flight, then stop and "
                   "exit 0 (default 0: stop at once); `dp-coordinator stop --graceful` "
                   "does the same on demand")
    p.add_argument("--loop", default=DEFAULTS.loop, choices=list(LOOP_CHOICES),
                   help="event loop (default auto: uvloop when installed)")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"], help="default info")
    p.add_argument("--log-format", default="text", choices=["text", "json"],
                   help="text (default) or json: one object per line with time, level, "
                   "logger, message and the event's fields")
    add_settings_arguments(p)
    add_observability_arguments(p)
    add_curve_arguments(p)
    add_bootstrap_arguments(p)


def add_settings_arguments(parser: argparse.ArgumentParser) -> None:
    """The `serve` flags that say where the other settings come from, or check them."""
    group = parser.add_argument_group("configuration")
    group.add_argument("--config", default=None, metavar="FILE",
                       help="read settings from a TOML file whose keys are these flags' "
                       "names (ipc-dir or ipc_dir); flags given here win over "
                       f"{ENV_PREFIX}* variables, which win over the file "
                       f"(default: {CONFIG_ENV}, else none)")
    group.add_argument("--check", action="store_true",
                       help="check the settings without binding anything (files writable, "
                       "keys readable and private, ports free, host resolvable), print "
                       "every problem and exit 2, or print ok and exit 0")


def add_prefix_arguments(parser: argparse.ArgumentParser) -> None:
    """The `serve` flags for KV cache events and the prefix policy."""
    group = parser.add_argument_group("prefix-cache routing")
    group.add_argument("--kv-events-endpoint", default=None, metavar="ENDPOINT",
                       help="follow every rank's KV cache event publisher: the endpoint as "
                       "given to vLLM's --kv-events-config (e.g. tcp://*:5557), offset by the "
                       "rank as vLLM's publisher does; a * host means the host the rank's "
                       "engine connected from, else loopback; where the publisher connects, "
                       "the coordinator binds. Engines that say where they publish (in their "
                       "greeting on dispatch) are followed there instead. Default: only those, "
                       "and only with --policy prefix")
    group.add_argument("--kv-events-replay-endpoint", default=None, metavar="ENDPOINT",
                       help="the publishers' replay endpoint (vLLM's replay_endpoint), offset "
                       "the same way: lost batches are asked for again there; without it a "
                       "lost batch empties that rank's index")
    group.add_argument("--kv-block-size", type=int, default=None, metavar="N",
                       help="tokens per KV cache block (default: from the engines' greetings, "
                       "else from their first stored block)")
    group.add_argument("--prefix-slack-tokens", type=float,
                       default=DEFAULTS.prefix_slack_tokens, metavar="T",
                       help="--policy prefix: the extra load, in tokens, accepted to keep a "
                       "request on the rank with its longest cached prefix or its "
                       "conversation (0: the lowest cost wins; default 256)")


def add_bootstrap_arguments(parser: argparse.ArgumentParser) -> None:
    """The `serve` flags of the KV bootstrap registry (vLLM's Mooncake P/D)."""
    group = parser.add_argument_group("KV bootstrap registry (prefill/decode with Mooncake)")
    group.add_argument("--kv-bootstrap-port", type=int, default=None, metavar="PORT",
                       help="serve vLLM's Mooncake bootstrap API (POST /register, GET /query, "
                       "GET /health) on PORT, for prefill engines started with "
                       "kv_connector_extra_config bootstrap_server_address=HOST:PORT; a "
                       "restarted engine replaces its old entry once the old one is proven "
                       "gone (0: any free port; default: off)")
    group.add_argument("--kv-bootstrap-host", default=None, metavar="H",
                       help="its address (default: --host, or 127.0.0.1 with ipc sockets); "
                       "anyone who reaches it can register workers, see docs/OPERATIONS.md")
    group.add_argument("--kv-bootstrap-tp-size", type=int, default=1, metavar="N",
                       help="the prefill engines' --tensor-parallel-size (default 1)")
    group.add_argument("--kv-bootstrap-pp-size", type=int, default=1, metavar="N",
                       help="the prefill engines' --pipeline-parallel-size (default 1)")
    group.add_argument("--kv-bootstrap-probe-timeout-s", type=float, default=2.0, metavar="S",
                       help="how long a probe of an old holder's side channel waits for a "
                       "connection before the holder counts as gone; keep it well below "
                       "vLLM's VLLM_MOONCAKE_CONNECTOR_TIMEOUT (30 s), since the registration "
                       "waits for it (default 2)")


def add_curve_arguments(parser: argparse.ArgumentParser) -> None:
    """The `serve` flags for CURVE and for binding beyond loopback."""
    group = parser.add_argument_group("security")
    group.add_argument("--curve-secret-key", default=None, metavar="FILE",
                       help="the coordinator's secret key file (NAME.key_secret): turns on "
                       "CURVE encryption and authentication on every TCP socket")
    group.add_argument("--curve-clients-dir", default=None, metavar="DIR",
                       help="directory of allowed client public keys (*.key); others are "
                       "refused and counted")
    group.add_argument("--admin-keys-dir", default=None, metavar="DIR",
                       help="directory of operators' public keys (*.key): CURVE connections "
                       "with these keys may run cordon/uncordon/drain/stop on the frontend "
                       "socket (without it, only the owner-only admin socket may)")
    group.add_argument("--insecure", action="store_true",
                       help="allow binding a non-loopback TCP address without CURVE keys")


def parse_bind_overrides(items: Sequence[str]) -> dict[str, str]:
    overrides: dict[str, str] = {}
    for item in items:
        key, sep, endpoint = item.partition("=")
        if not sep or not key or not endpoint:
            raise ValueError(f"--bind wants KEY=ENDPOINT, got {item!r}")
        overrides[key] = endpoint
    return overrides


def run_serve(args: argparse.Namespace) -> int:
    """Build the server configuration from the flags and run (or check) the coordinator."""
    # Imported here: every tool builds the parser (the vLLM drop-in too, to check a
    # flag), and only `serve` needs the server itself.
    from coordinator.server.logformat import configure_logging
    from coordinator.server.preflight import check_settings
    from coordinator.server.run import run_server

    problems = list(getattr(args, "settings_problems", []))
    if args.engines is None:
        problems.append("give --engines N (or engines = N in the --config file, or "
                        "DP_COORDINATOR_ENGINES)")
    try:
        config = server_config(args, engines=args.engines or 1)
    except ValueError as exc:
        problems.append(str(exc))
        config = None
    if args.check:
        if config is not None:
            problems += check_settings(config)
        for problem in problems:
            print(f"dp-coordinator serve --check: {problem}", file=sys.stderr)
        if problems:
            return 2
        print("ok", flush=True)
        return 0
    if problems or config is None:
        for problem in problems:
            print(f"dp-coordinator serve: error: {problem}", file=sys.stderr)
        return 2
    configure_logging(args.log_level, args.log_format)
    return run_server(config)


def server_config(args: argparse.Namespace, *, engines: int) -> ServerConfig:
    """The server's settings from the parsed (and layered) flags."""
    return ServerConfig(
        engines=engines,
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
        frontend_lease_ttl_s=args.frontend_lease_ttl_s,
        min_engines=args.min_engines,
        max_engines=args.max_engines,
        max_request_bytes=args.max_request_bytes,
        max_engine_message_bytes=args.max_engine_message_bytes,
        master_ip=args.master_ip,
        master_port=args.master_port,
        coord_store_port=args.coord_store_port,
        vllm_compat=args.vllm_compat,
        frontend_wake=args.frontend_wake == "honour",
        require_supported_vllm=args.require_supported_vllm,
        loop=args.loop,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        watchdog_stall_s=args.watchdog_stall_s,
        watchdog_rewake=args.watchdog_rewake,
        recorder_size=args.recorder_size,
        curve_secret_key=args.curve_secret_key,
        curve_clients_dir=args.curve_clients_dir,
        admin_keys_dir=args.admin_keys_dir,
        insecure=args.insecure,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_replay_endpoint=args.kv_events_replay_endpoint,
        kv_block_size=args.kv_block_size,
        prefix_slack_tokens=args.prefix_slack_tokens,
        graceful_stop_s=args.graceful_stop_s,
        kv_bootstrap_port=args.kv_bootstrap_port,
        kv_bootstrap_host=args.kv_bootstrap_host,
        kv_bootstrap_tp_size=args.kv_bootstrap_tp_size,
        kv_bootstrap_pp_size=args.kv_bootstrap_pp_size,
        kv_bootstrap_probe_timeout_s=args.kv_bootstrap_probe_timeout_s,
    )
