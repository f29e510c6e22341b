"""Endpoint forms and the bind safety rule: pure address arithmetic, no sockets."""

from __future__ import annotations

import pytest

from coordinator.protocol.addresses import (
    SOCKET_KEYS,
    bind_host,
    check_bind_safety,
    is_ipv6_tcp,
    is_loopback_host,
    tcp_endpoint,
)
from coordinator.server.config import ServerConfig
from coordinator.server.sockets import socket_specs


def test_socket_keys_are_the_servers_in_bind_order() -> None:
    assert SOCKET_KEYS == ("handshake", "dispatch", "back_output", "back_publish",
                           "front_publish", "frontend")
    # The server binds in this order, which is what gives each socket its port under
    # --port-base.
    assert tuple(key for key, _, _ in socket_specs(ServerConfig(engines=1))) == SOCKET_KEYS


@pytest.mark.parametrize(("endpoint", "ipv6"), [
    ("tcp://[::1]:5555", True),
    ("tcp://[fe80::1%eth0]:0", True),
    ("tcp://127.0.0.1:5555", False),
    ("tcp://localhost:0", False),
    ("ipc:///tmp/[x]", False),
    ("[::1]", False),
])
def test_is_ipv6_tcp(endpoint: str, ipv6: bool) -> None:
    assert is_ipv6_tcp(endpoint) is ipv6


@pytest.mark.parametrize(("host", "port", "endpoint"), [
    ("127.0.0.1", 0, "tcp://127.0.0.1:0"),
    ("localhost", 5555, "tcp://localhost:5555"),
    ("::1", 0, "tcp://[::1]:0"),
    ("[::1]", 7, "tcp://[::1]:7"),
    ("*", 0, "tcp://*:0"),
])
def test_tcp_endpoint(host: str, port: int, endpoint: str) -> None:
    assert tcp_endpoint(host, port) == endpoint
    assert is_ipv6_tcp(endpoint) is (":" in host)
    assert bind_host(endpoint) == host.strip("[]")


@pytest.mark.parametrize(("address", "host"), [
    ("0.0.0.0", "0.0.0.0"),
    ("[::1]", "::1"),
    ("tcp://10.0.0.5:5555", "10.0.0.5"),
    ("tcp://[::1]:0", "::1"),
    ("tcp://*:0", "*"),
    ("tcp://127.0.0.1", "127.0.0.1"),
    ("ipc:///tmp/dp/handshake", None),
    ("inproc://x", None),
])
def test_bind_host(address: str, host: str | None) -> None:
    assert bind_host(address) == host


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("localhost", True),
    ("LOCALHOST", True), ("0.0.0.0", False), ("::", False), ("10.1.2.3", False),
    ("192.168.0.1", False), ("*", False), ("example.com", False), ("128.0.0.1", False),
])
def test_is_loopback_host(host: str, loopback: bool) -> None:
    assert is_loopback_host(host) is loopback


@pytest.mark.parametrize(("host", "has_keys", "insecure", "refused"), [
    (None, False, False, False),  # ipc
    ("ipc:///tmp/x", False, False, False),
    ("127.0.0.1", False, False, False),
    ("127.0.0.2", False, False, False),
    ("::1", False, False, False),
    ("[::1]", False, False, False),
    ("localhost", False, False, False),
    ("tcp://127.0.0.1:5555", False, False, False),
    ("0.0.0.0", False, False, True),
    ("::", False, False, True),
    ("10.0.0.5", False, False, True),
    ("tcp://*:5555", False, False, True),
    ("node7.cluster", False, False, True),
    ("0.0.0.0", True, False, False),
    ("0.0.0.0", False, True, False),
    ("10.0.0.5", True, True, False),
])
def test_check_bind_safety(host: str | None, has_keys: bool, insecure: bool,
                           refused: bool) -> None:
    if refused:
        with pytest.raises(ValueError) as info:
            check_bind_safety(host, has_keys=has_keys, insecure=insecure)
        message = str(info.value)
        assert "not a loopback address" in message
        assert "--curve-secret-key" in message
        assert "--insecure" in message
        assert repr(host) in message
    else:
        check_bind_safety(host, has_keys=has_keys, insecure=insecure)
