"""Run one coordinator process: bind, serve until a signal, clean up, exit code."""

from __future__ import annotations

import asyncio
import json
import logging
import signal

import zmq

from coordinator import __version__
from coordinator._zmq import run_loop
from coordinator.server.app import AddressFileError, CoordinatorServer
from coordinator.server.config import ServerConfig
from coordinator.server.curve import CurveKeyError
from coordinator.server.fdlimit import ensure_descriptors
from coordinator.server.signals import HANDLED, ProcessSignals
from coordinator.server.statefile import StateFileError

log = logging.getLogger("coordinator.server")

STOP_SIGNALS = HANDLED

EXIT_OK = 0
EXIT_FATAL = 1
EXIT_CONFIG = 2


async def serve_until_signal(server: CoordinatorServer, signals: ProcessSignals) -> int:
    signals.install_on_loop(asyncio.get_running_loop())
    # Signals were blocked since before bind(); one that came meanwhile is delivered
    # now, to the handlers above, so an early SIGTERM still cleans up.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    try:
        await server.serve(signals.stop)
    finally:
        # Cleanup runs after the loop is gone: keep handling signals until it ends.
        signals.hand_over_from_loop()
    return EXIT_OK


def run_server(config: ServerConfig, *, print_addresses: bool = True) -> int:
    """Bind, serve until SIGTERM/SIGINT, close; return the process exit code."""
    try:
        server = CoordinatorServer(config)
    except ValueError as exc:
        log.error("bad configuration: %s", exc)
        return EXIT_CONFIG
    limit = ensure_descriptors(config.engines, config.frontends)
    if limit.refusal is not None:
        log.error("not enough file descriptors: %s", limit.refusal)
        return EXIT_CONFIG
    if limit.raised_to is not None:
        log.info("raised the open-file limit from %d to %d (this group needs about %d)",
                 limit.soft, limit.raised_to, limit.needed)
    else:
        log.info("open-file limit %d (this group needs about %d)", limit.soft, limit.needed)
    # The address file tells launchers we are up, and they may stop us at once: hold
    # SIGTERM/SIGINT until the loop's handlers can close sockets and remove files.
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        addresses = server.bind()
    except (zmq.ZMQError, OSError) as exc:
        log.error("could not bind the coordinator sockets: %s", exc)
        server.close()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        return EXIT_FATAL
    except AddressFileError as exc:
        log.error("%s", exc)
        server.close()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        return EXIT_CONFIG
    except CurveKeyError as exc:
        log.error("bad CURVE keys: %s", exc)
        server.close()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        return EXIT_CONFIG
    except StateFileError as exc:
        log.error("%s", exc)
        server.close()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        return EXIT_CONFIG
    log.info(
        "coordinator up: %d engines (ranks %d..%d), %s mode, frontends expected: %d, "
        "version %s",
        config.engines,
        config.rank_start,
        config.rank_start + config.engines - 1,
        "lockstep" if config.lockstep else "dense",
        config.frontends,
        __version__,
        extra={"event": "started", "version": __version__, "engines": config.engines,
               "rank_start": config.rank_start, "addresses": addresses},
    )
    for key, address in addresses.items():
        log.info("  %-13s %s", key, address)
    if print_addresses:
        print(json.dumps(addresses, sort_keys=True), flush=True)
    signals = ProcessSignals(server)
    try:
        return run_loop(serve_until_signal(server, signals), config.loop)
    except Exception:
        log.exception("coordinator failed")
        return EXIT_FATAL
    finally:
        log.info("closing the sockets and removing the address file and ipc sockets")
        server.close()
        log.info("coordinator stopped", extra={"event": "stopped"})
