"""The torch DP meeting point that every rank's INIT carries (lockstep mode only).

Headless engines on different nodes form their torch DP process group only if
every rank gets the same meeting point. Like vLLM's rank-0 launcher, the
coordinator sends every rank identical ``data_parallel_master_ip``,
``data_parallel_master_port``, ``_data_parallel_master_port_list`` and
``data_parallel_size`` (plus ``_coord_store_port`` when one is configured):

==========================  ==========================================================
given                       meeting point
==========================  ==========================================================
``--master-ip``             that host and ``--master-port``; the spare ports are
                            ``--master-port-list``, else the five above the port (the
                            same list for every rank: left empty, a rank could pick
                            its own local ones)
no ``--master-ip``          the coordinator's advertised host (loopback when bound on
                            ipc or a wildcard), where rank 0 is assumed to run as with
                            vLLM's launcher; ports found free there at start-up unless
                            given
dense mode                  nothing: engines that never step together need no group
==========================  ==========================================================

Pure: the caller finds the free ports (``FREE_PORTS`` of them, only when
``needs_free_ports``) and passes them in.
"""

from __future__ import annotations

from collections.abc import Sequence

ParallelConfig = dict[str, int | str | list[int]]

FREE_PORTS = 6  # the master port and five spares


def needs_free_ports(*, lockstep: bool, master_ip: str | None) -> bool:
    return lockstep and master_ip is None


def meeting_host(host: str | None) -> str:
    """Where rank 0 is assumed to run when no ``--master-ip`` is given."""
    if host is None or host in ("0.0.0.0", "::"):
        return "127.0.0.1"
    return host


def parallel_config(
    *,
    lockstep: bool,
    host: str | None,
    master_ip: str | None,
    master_port: int | None,
    master_port_list: Sequence[int],
    coord_store_port: int | None,
    data_parallel_size: int,
    free_ports: Sequence[int] = (),
) -> ParallelConfig:
    """The ``parallel_config`` of every INIT; see the table in the module docstring."""
    if not lockstep:
        return {}
    if master_ip is not None:
        meeting = master_ip
        port = master_port if master_port is not None else 0
        spares = list(master_port_list) or [port + i for i in range(1, FREE_PORTS)]
    else:
        if len(free_ports) < FREE_PORTS:
            raise ValueError(f"need {FREE_PORTS} free ports, got {len(free_ports)}")
        meeting = meeting_host(host)
        port = master_port if master_port is not None else free_ports[0]
        spares = list(master_port_list) or list(free_ports[1:FREE_PORTS])
    payload: ParallelConfig = {
        "data_parallel_master_ip": meeting,
        "data_parallel_master_port": port,
        "_data_parallel_master_port_list": spares,
        "data_parallel_size": data_parallel_size,
    }
    if coord_store_port is not None:
        payload["_coord_store_port"] = coord_store_port
    return payload
