"""Addresses: the coordinator's socket keys, endpoint forms, and which binds are safe.

Pure string and address arithmetic, no sockets and no name resolution, so the
server, the SDKs and the tools agree on what an endpoint means.

ZeroMQ has no authentication of its own: anyone who can reach a TCP port can
register as an engine, submit requests or read every rank's load. Binds
therefore default to ipc or loopback, and `check_bind_safety` refuses a
non-loopback TCP bind unless CURVE keys are configured or the operator says
`--insecure`.
"""

from __future__ import annotations

import ipaddress
from typing import Final

__all__ = [
    "SOCKET_KEYS",
    "bind_host",
    "check_bind_safety",
    "is_ipv6_tcp",
    "is_loopback_host",
    "tcp_endpoint",
]

#: The coordinator's sockets by their address-file key, in bind order (`--port-base`
#: gives them consecutive ports in this order).
SOCKET_KEYS: Final = (
    "handshake", "dispatch", "back_output", "back_publish", "front_publish", "frontend",
)

_LOOPBACK_NAMES: Final = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


def is_ipv6_tcp(endpoint: str) -> bool:
    """True for a ZeroMQ TCP endpoint with a bracketed IPv6 host (``tcp://[::1]:5555``).

    libzmq refuses such an endpoint unless the socket has ``IPV6`` set.
    """
    return endpoint.startswith("tcp://[")


def tcp_endpoint(host: str, port: int = 0) -> str:
    """``tcp://host:port``, with an IPv6 host put in brackets; port 0 binds a free port."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


def bind_host(address: str) -> str | None:
    """The host part of a bind address, or None when it is not TCP (ipc, inproc).

    Takes a bare host (``0.0.0.0``, ``[::1]``, ``localhost``) or a ZeroMQ endpoint
    (``tcp://10.0.0.5:5555``, ``tcp://[::1]:0``, ``ipc:///tmp/x``).
    """
    if "://" in address:
        scheme, rest = address.split("://", 1)
        if scheme != "tcp":
            return None
        address = rest.rsplit(":", 1)[0] if rest.count(":") == 1 or "]" in rest else rest
    return address.strip("[]")


def is_loopback_host(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and localhost; names are not resolved."""
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind_safety(host: str | None, *, has_keys: bool, insecure: bool) -> None:
    """Refuse (ValueError) a non-loopback TCP bind without CURVE keys unless ``insecure``.

    ``host`` is what `--host` gave (None: ipc), a bare address, or a ZeroMQ endpoint.
    """
    if host is None or has_keys or insecure:
        return
    tcp_host = bind_host(host)
    if tcp_host is None or is_loopback_host(tcp_host):
        return
    raise ValueError(
        f"refusing to bind {host!r} without CURVE keys: it is not a loopback address, so "
        "any host that can reach it could register as an engine, submit requests and read "
        "every rank's load (ZeroMQ does no authentication by itself). Either configure "
        "keys with --curve-secret-key and --curve-clients-dir (make them with "
        "`dp-coordinator keygen`), bind 127.0.0.1 or ipc (the default), or pass "
        "--insecure if only trusted hosts can reach this network."
    )
