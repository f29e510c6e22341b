"""`python -m coordinator.sim`: simulated engines, a group or the hub as a process."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence

from coordinator._zmq import (
    AddressFileTimeout,
    CurveClientKeys,
    run_loop,
    wait_for_address_file,
)
from coordinator.engine import EngineRefused, EngineStartupError
from coordinator.sim.collective import CollectiveHang, CollectiveHub
from coordinator.sim.engine import SimConfig, SimEngine
from coordinator.sim.group import SimEngineGroup
from coordinator.sim.kv_publisher import resolve_endpoints

__all__ = [
    "EXIT_ERROR",
    "EXIT_HANG",
    "EXIT_OK",
    "EXIT_REFUSED",
    "EXIT_STARTUP",
    "build_parser",
    "main",
]

logger = logging.getLogger("coordinator.sim")

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_REFUSED = 2
EXIT_HANG = 3
EXIT_STARTUP = 4

_EPILOG = """\
Exit status: 0 after SIGTERM/SIGINT, 2 if the coordinator refused an engine,
3 if an engine died of a collective hang (--on-hang fail), 4 if startup failed
or timed out, 1 otherwise. On exit one JSON line per engine is printed to
stdout with what it did (steps, waves sent, hangs).

Examples:
  python -m coordinator.sim group --engines 2 --addr-file /tmp/coord.json
  python -m coordinator.sim hub --engines 2 --bind ipc:///tmp/sim-hub
  python -m coordinator.sim engine --rank 1 --engines 2 --addr-file /tmp/coord.json \\
      --collective ipc:///tmp/sim-hub
"""


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--addr-file",
        help="the coordinator's JSON address file (its 'handshake' key is used); "
        "waited for if it does not exist yet",
    )
    where.add_argument("--handshake", help="the coordinator's handshake address")
    p.add_argument("--engines", type=int, required=True, help="DP group size (world size)")
    p.add_argument("--rank-start", type=int, default=0, help="first global rank of the group")
    p.add_argument("--step-ms", type=float, default=5.0, help="time per step, ms (default 5)")
    p.add_argument("--max-batch", type=int, default=64, help="max running requests per engine")
    p.add_argument(
        "--sync-interval",
        type=int,
        default=16,
        help="honour the reduced unfinished flag every N steps, as vLLM's dp_sync_interval",
    )
    p.add_argument(
        "--collective-timeout",
        type=float,
        default=10.0,
        help="seconds a rank waits in a collective before recording a hang (default 10)",
    )
    p.add_argument(
        "--on-hang",
        choices=["fail", "wait"],
        default="fail",
        help="after a collective hang: die like a timed-out vLLM engine, or keep waiting",
    )
    cache = p.add_argument_group(
        "KV cache and prefill",
        "Requests sent as vLLM EngineCoreRequest payloads have prompts: their KV "
        "takes blocks, full blocks stay cached (LRU) and later prompts with the same "
        "prefix skip computing it. SimRequest payloads have no prompt and are untouched.",
    )
    cache.add_argument("--block-size", type=int, default=16, help="tokens per KV block (16)")
    cache.add_argument(
        "--kv-blocks", type=int, default=4096, help="KV cache capacity per engine, in blocks (4096)"
    )
    cache.add_argument(
        "--no-prefix-caching", action="store_true", help="never reuse cached blocks (vLLM's "
        "--no-enable-prefix-caching)"
    )
    cache.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=8192,
        help="tokens computed per step across the batch; longer prefills are chunked (8192)",
    )
    cache.add_argument(
        "--prefill-us-per-token",
        type=float,
        default=5.0,
        help="time a step takes per prompt token it computes, on top of --step-ms (5 us)",
    )
    cache.add_argument(
        "--no-log-stats",
        action="store_true",
        help="send frontends no prefix-cache statistics (vLLM's --disable-log-stats)",
    )
    events = p.add_argument_group(
        "KV cache events",
        "Published as vLLM's --kv-events-config publisher does: each rank offsets the "
        "port by its DP rank, binds a wildcard host (tcp://*:PORT) or ipc endpoint and "
        "connects to any other. SIGUSR2 resets every engine's prefix cache "
        "(AllBlocksCleared), sending running requests back to the queue.",
    )
    events.add_argument(
        "--kv-events-endpoint", metavar="ENDPOINT", help="publish BlockStored/BlockRemoved/"
        "AllBlocksCleared batches here, e.g. tcp://*:5557 (default: no events)"
    )
    events.add_argument(
        "--kv-events-replay-endpoint", metavar="ENDPOINT",
        help="serve replays of recent batches here (a ROUTER, always bound)",
    )
    events.add_argument(
        "--kv-events-buffer-steps", type=int, default=10_000, metavar="N",
        help="batches kept for replay (10000)",
    )
    events.add_argument("--kv-events-topic", default="", help="topic frame of every batch")
    p.add_argument("--dense", action="store_true", help="no waves, no collective (non-MoE)")
    p.add_argument("--no-stats", action="store_true", help="send no load stats (external LB)")
    p.add_argument(
        "--vllm-shaped",
        action="store_true",
        help="send exactly vLLM 0.33's handshake bytes and do not wait for ACCEPTED",
    )
    p.add_argument("--config-hash", help="parallel_config_hash sent in READY")
    p.add_argument(
        "--heartbeat",
        type=float,
        default=2.0,
        help="seconds of coordinator silence before a heartbeat; 0 disables",
    )
    p.add_argument("--ready-timeout", type=float, default=120.0, help="startup wait, seconds")
    p.add_argument(
        "--wait-addr-file", type=float, default=30.0, help="seconds to wait for --addr-file"
    )
    p.add_argument(
        "--ignore-start-wave",
        type=int,
        action="append",
        default=[],
        metavar="RANK",
        help="fault injection: this rank drops START_DP_WAVE (repeatable)",
    )
    p.add_argument(
        "--curve-secret-key",
        metavar="FILE",
        help="this engine's secret key file (NAME.key_secret): CURVE to a coordinator on tcp",
    )
    p.add_argument(
        "--curve-server-key",
        metavar="FILE",
        help="the coordinator's public key file (NAME.key); needs --curve-secret-key",
    )
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--loop", choices=["auto", "asyncio", "uvloop"], default="auto")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m coordinator.sim",
        description="Simulated lockstep DP engines that speak vLLM 0.33's engine wire "
        "protocol to a coordinator. Lockstep ranks meet in a per-step collective "
        "at a hub; a rank that is never woken makes its peers block there, and the "
        "block is reported as a collective hang.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    group = sub.add_parser(
        "group",
        help="run every rank of a group in this process, with its collective hub",
        description="Run --engines simulated ranks as tasks in one process; the "
        "collective hub runs here too.",
    )
    _add_engine_options(group)
    group.add_argument(
        "--collective",
        default="tcp://127.0.0.1:0",
        help="address the hub binds (default: a free TCP port on 127.0.0.1)",
    )

    engine = sub.add_parser(
        "engine",
        help="run one rank (so a test can kill -9 it alone)",
        description="Run one simulated rank. All ranks of a lockstep group must use the "
        "same --collective address; exactly one process binds it: a 'hub' process, or "
        "one engine given --host-collective.",
    )
    _add_engine_options(engine)
    engine.add_argument("--rank", type=int, required=True, help="this engine's global rank")
    engine.add_argument("--collective", help="collective hub address (required unless --dense)")
    engine.add_argument(
        "--host-collective", action="store_true", help="bind the collective hub in this process"
    )
    engine.add_argument("--engine-id", help="engine_id sent in HELLO (default: random)")

    hub = sub.add_parser(
        "hub",
        help="run only the collective hub of a group",
        description="Bind the per-step collective hub for a group of simulated engines.",
    )
    hub.add_argument("--bind", required=True, help="address to bind, e.g. ipc:///tmp/hub")
    hub.add_argument("--engines", type=int, required=True, help="DP group size")
    hub.add_argument("--rank-start", type=int, default=0)
    hub.add_argument("--log-level", default="INFO")
    hub.add_argument("--loop", choices=["auto", "asyncio", "uvloop"], default="auto")
    return parser


def _config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        world_size=args.engines,
        rank_start=args.rank_start,
        step_time_s=args.step_ms / 1000.0,
        max_batch=args.max_batch,
        dp_sync_interval=args.sync_interval,
        collective_timeout_s=args.collective_timeout,
        on_hang=args.on_hang,
        lockstep=not args.dense,
        publish_stats=not args.no_stats,
        vllm_shaped=args.vllm_shaped,
        engine_id=getattr(args, "engine_id", None),
        parallel_config_hash=args.config_hash,
        heartbeat_interval_s=args.heartbeat if args.heartbeat > 0 else None,
        ready_timeout_s=args.ready_timeout,
        curve_secret_key=args.curve_secret_key,
        curve_server_key=args.curve_server_key,
        block_size=args.block_size,
        kv_blocks=args.kv_blocks,
        enable_prefix_caching=not args.no_prefix_caching,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_s_per_token=args.prefill_us_per_token / 1e6,
        log_stats=not args.no_log_stats,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_replay_endpoint=args.kv_events_replay_endpoint,
        kv_events_buffer_steps=args.kv_events_buffer_steps,
        kv_events_topic=args.kv_events_topic,
    )


def _reset_on_signal(engines: Sequence[SimEngine]) -> None:
    """SIGUSR2: reset every engine's prefix cache, preempting running requests."""

    def reset() -> None:
        for engine in engines:
            engine.reset_prefix_cache(reset_running_requests=True)

    with contextlib.suppress(NotImplementedError, RuntimeError, AttributeError):
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR2, reset)


async def _handshake_address(args: argparse.Namespace) -> str:
    if args.handshake:
        return str(args.handshake)
    path = str(args.addr_file)
    try:
        # In a thread, so a hub this process already serves keeps serving meanwhile.
        addresses = await asyncio.to_thread(
            wait_for_address_file, path, ("handshake",), args.wait_addr_file, poll_s=0.05
        )
    except AddressFileTimeout as exc:
        raise EngineStartupError(str(exc)) from None
    return addresses["handshake"]


def _stop_event() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    return stop


async def _until_stop_or_failure(stop: asyncio.Event, engines: Sequence[SimEngine]) -> None:
    waiters = [asyncio.ensure_future(stop.wait())]
    waiters += [asyncio.ensure_future(engine.done.wait()) for engine in engines]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


def _exit_status(engines: Sequence[SimEngine]) -> int:
    for engine in engines:
        print(json.dumps(engine.summary()), flush=True)
    failures = [engine.failed for engine in engines if engine.failed is not None]
    if any(isinstance(f, CollectiveHang) for f in failures):
        return EXIT_HANG
    return EXIT_ERROR if failures else EXIT_OK


async def _run_group(args: argparse.Namespace) -> int:
    stop = _stop_event()
    group = SimEngineGroup(
        await _handshake_address(args),
        args.engines,
        config=_config_from_args(args),
        collective_address=args.collective,
    )
    await group.start()
    _reset_on_signal(group.engines)
    for rank in args.ignore_start_wave:
        group.engine(rank).ignore_start_wave = True
    try:
        await _until_stop_or_failure(stop, group.engines)
    finally:
        await group.stop()
    return _exit_status(group.engines)


async def _run_engine(args: argparse.Namespace) -> int:
    config = _config_from_args(args)
    stop = _stop_event()
    hub: CollectiveHub | None = None
    collective = args.collective
    if config.lockstep and args.host_collective:
        hub = CollectiveHub(collective, config.world_size, rank_start=config.rank_start)
        collective = await hub.start()
    engine = SimEngine(
        args.rank, await _handshake_address(args), config=config, collective_address=collective
    )
    engine.ignore_start_wave = args.rank in args.ignore_start_wave
    try:
        await engine.start()
        _reset_on_signal([engine])
        await _until_stop_or_failure(stop, [engine])
    finally:
        await engine.stop()
        if hub is not None:
            await hub.close()
    return _exit_status([engine])


async def _run_hub(args: argparse.Namespace) -> int:
    stop = _stop_event()
    hub = CollectiveHub(args.bind, args.engines, rank_start=args.rank_start)
    address = await hub.start()
    print(json.dumps({"collective": address}), flush=True)
    try:
        await stop.wait()
    finally:
        await hub.close()
    return EXIT_OK


async def _dispatch(args: argparse.Namespace) -> int:
    try:
        if args.command == "group":
            return await _run_group(args)
        if args.command == "engine":
            return await _run_engine(args)
        return await _run_hub(args)
    except EngineRefused as exc:
        logger.error("%s", exc)
        return EXIT_REFUSED
    except EngineStartupError as exc:
        logger.error("%s", exc)
        return EXIT_STARTUP


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "engine" and not args.dense and not args.collective:
        parser.error("engine: --collective is required for a lockstep engine (or use --dense)")
    if args.command in ("group", "engine"):
        try:
            CurveClientKeys.from_options(args.curve_secret_key, args.curve_server_key)
            config = _config_from_args(args)
            config.scheduler_config().validate()
            if config.kv_events_endpoint is not None:
                ranks = config.group_ranks if args.command == "group" else [args.rank]
                for rank in ranks:
                    resolve_endpoints(
                        config.kv_events_endpoint, config.kv_events_replay_endpoint, rank
                    )
        except ValueError as exc:
            parser.error(str(exc))
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format=f"%(asctime)s %(levelname)s [sim {os.getpid()}] %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return run_loop(_dispatch(args), args.loop)
