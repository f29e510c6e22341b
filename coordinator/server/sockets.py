"""The coordinator's sockets: kinds and options of the six vLLM defines, and the
operators' owner-only ``admin`` socket."""

from __future__ import annotations

import os
import stat

import zmq

from coordinator.core.ranks import liveness
from coordinator.server.config import ServerConfig
from coordinator.server.stats_reader import BACK_OUTPUT_RCVHWM
from coordinator.server.tempdirs import make_own_dir, sweep_stale_dirs
from coordinator.server.transport import PUBLISH_UPSTREAM_RCVHWM, bind_socket

SocketSpec = tuple[str, int, list[tuple[int, int]]]


def binds_tcp(config: ServerConfig, key: str) -> bool:
    """Whether socket ``key`` is bound on tcp (else ipc)."""
    override = config.bind_overrides.get(key)
    return override.startswith("tcp://") if override else config.host is not None


def socket_specs(config: ServerConfig) -> list[SocketSpec]:
    """The six sockets in bind order (``--port-base`` counts in this order)."""
    # ZMTP heartbeats: a peer that stops answering (a host cut off, a frozen process)
    # is disconnected, so an open connection proves its engine was heard within
    # liveness.heard_within_s (core.liveness says why the numbers are what they are).
    ttl = config.lease_ttl_s
    pings = [(zmq.HEARTBEAT_IVL, int(liveness.heartbeat_ivl_s(ttl) * 1000))]
    timeout_ms = int(liveness.heartbeat_timeout_s(ttl) * 1000)
    heartbeats = [*pings, (zmq.HEARTBEAT_TIMEOUT, timeout_ms)]
    # A dispatch connection over tcp is not dropped for silence (only after
    # liveness.TCP_SILENCE_LIMIT_S, a backstop): a drop cannot reach a host cut off by
    # a partition, whose engine would then never reconnect; what arrived on it is
    # read from the kernel instead. (Without a timeout libzmq would use the interval.)
    limit_ms = int(liveness.TCP_SILENCE_LIMIT_S * 1000)
    tcp_pings = [*pings, (zmq.HEARTBEAT_TIMEOUT, limit_ms)]
    dispatch = tcp_pings if binds_tcp(config, "dispatch") else heartbeats
    publish: list[tuple[int, int]] = [(zmq.XPUB_VERBOSE, 1), (zmq.RCVHWM, PUBLISH_UPSTREAM_RCVHWM)]
    return [
        # No ROUTER_HANDOVER on either: a rank's identity belongs to the first live
        # connection that carries it, and libzmq turns a second one away, silently,
        # until the first is gone (core.claims; docs/OPERATIONS.md). With handover, any
        # connection carrying a live rank's identity would take its requests.
        ("handshake", zmq.ROUTER, [(zmq.ROUTER_MANDATORY, 1), *heartbeats]),
        ("dispatch", zmq.ROUTER, [(zmq.ROUTER_MANDATORY, 1), (zmq.SNDHWM, 0), *dispatch]),
        # Bounded, unlike vLLM's: see BACK_OUTPUT_RCVHWM.
        ("back_output", zmq.PULL, [(zmq.RCVHWM, BACK_OUTPUT_RCVHWM)]),
        # Topics are bounded in server.subscriptions.
        ("back_publish", zmq.XPUB, publish),
        ("front_publish", zmq.XPUB, publish),
        ("frontend", zmq.ROUTER, [(zmq.ROUTER_MANDATORY, 1), (zmq.ROUTER_HANDOVER, 1)]),
    ]


def bind_admin(ctx: zmq.Context[zmq.Socket[bytes]], ipc_dir: str | None,
               max_message_bytes: int) -> tuple[zmq.Socket[bytes], str, str]:
    """The operators' socket: ipc in a private directory (``admin.d`` in the ipc
    directory, or a new temporary one), the file owner-only. Returns the socket, its
    endpoint and the directory (removed at close).

    Connecting to a unix socket needs write permission on its file, so only this
    process's user (and root) can reach it; that is the authority of what comes
    in on it (see core.authority). Directories killed coordinators left in the temp
    directory are removed first (see server.tempdirs).
    """
    sweep_stale_dirs()
    if ipc_dir is not None:
        admin_dir = os.path.join(ipc_dir, "admin.d")
        os.makedirs(admin_dir, mode=stat.S_IRWXU, exist_ok=True)
        os.chmod(admin_dir, stat.S_IRWXU)
    else:
        admin_dir = make_own_dir("admin")
    path = os.path.join(admin_dir, "admin")
    sock, resolved = bind_socket(
        ctx, zmq.ROUTER, f"ipc://{path}", max_message_bytes=max_message_bytes,
        options=[(zmq.ROUTER_MANDATORY, 1), (zmq.ROUTER_HANDOVER, 1)],
    )
    os.chmod(path, stat.S_IRUSR | stat.S_IWUSR)
    return sock, resolved, admin_dir
