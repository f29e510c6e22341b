"""Free ports for the DP meeting point (the rule is ``coordinator.core.meeting_point``)."""

from __future__ import annotations

import socket

from coordinator.core import meeting_point
from coordinator.server.config import ServerConfig


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


def build_parallel_config(cfg: ServerConfig) -> meeting_point.ParallelConfig:
    """The `parallel_config` of every INIT, with free ports looked up where they are needed."""
    free: list[int] = []
    if meeting_point.needs_free_ports(lockstep=cfg.lockstep, master_ip=cfg.master_ip):
        free = free_tcp_ports(meeting_point.meeting_host(cfg.host), meeting_point.FREE_PORTS)
    return meeting_point.parallel_config(
        lockstep=cfg.lockstep, host=cfg.host, master_ip=cfg.master_ip,
        master_port=cfg.master_port, master_port_list=cfg.master_port_list,
        coord_store_port=cfg.coord_store_port,
        data_parallel_size=cfg.rank_start + cfg.engines, free_ports=free,
    )
