"""The torch DP meeting point that INIT gives every rank (lockstep mode only)."""

from __future__ import annotations

import socket

from coordinator.server.config import ServerConfig

ParallelConfig = dict[str, int | str | list[int]]


def free_tcp_ports(host: str, count: int) -> list[int]:
    """Ports free on `host` right now."""
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def build_parallel_config(cfg: ServerConfig) -> ParallelConfig:
    """The `parallel_config` of every INIT: the same meeting point for every rank.

    By default rank 0 is assumed to run on the coordinator's host, as with vLLM's
    rank-0 launcher: free ports are found there. With --master-ip the meeting
    point is elsewhere, so its port must be given, and the spare ports are the
    five above it (the same list for every rank).
    """
    if not cfg.lockstep:
        return {}
    if cfg.master_ip is not None:
        host = cfg.master_ip
        master_port = cfg.master_port if cfg.master_port is not None else 0
        # Every rank must get the same spare ports; left empty, a rank could pick its
        # own local ones.
        ports = list(cfg.master_port_list) or [master_port + i for i in range(1, 6)]
    else:
        host = cfg.host if cfg.host not in (None, "0.0.0.0", "::") else "127.0.0.1"
        found = free_tcp_ports(host, 6)
        master_port = cfg.master_port if cfg.master_port is not None else found[0]
        ports = list(cfg.master_port_list) or found[1:]
    payload: ParallelConfig = {
        "data_parallel_master_ip": host,
        "data_parallel_master_port": master_port,
        "_data_parallel_master_port_list": ports,
        "data_parallel_size": cfg.rank_start + cfg.engines,
    }
    if cfg.coord_store_port is not None:
        payload["_coord_store_port"] = cfg.coord_store_port
    return payload
