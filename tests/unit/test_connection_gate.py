"""Connection budgets on their own: shares of the open-file limit, and refusal at the budget."""

from __future__ import annotations

import logging
import socket
from collections import Counter

import pytest

from coordinator.protocol.addresses import SOCKET_KEYS
from coordinator.server.connection_gate import (
    FRONTEND_SOCKETS,
    SocketGate,
    connection_budgets,
)
from coordinator.server.fdlimit import MIN_FRONTENDS, RESERVE
from coordinator.server.transport import RateLimitedLog


def test_budgets_share_half_the_limit_beyond_the_plan() -> None:
    budgets = connection_budgets(1024, 10, 0)
    assert set(budgets) == set(SOCKET_KEYS)
    assert sum(budgets.values()) <= 1024 // 2
    for key, budget in budgets.items():
        planned = MIN_FRONTENDS if key in FRONTEND_SOCKETS else 10
        assert budget > planned
    # A plan larger than half the limit gets what it needs, and the process its reserve.
    big = connection_budgets(4 * 200 + 2 * 16 + RESERVE, 200, 0)
    assert all(big[key] >= (MIN_FRONTENDS if key in FRONTEND_SOCKETS else 200) for key in big)


def test_a_connection_past_the_budget_is_shut_down_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    counters: Counter[str] = Counter()
    gate = SocketGate("frontend", 2, counters,
                      RateLimitedLog(logging.getLogger("coordinator.server")))
    pairs = [socket.socketpair() for _ in range(3)]
    try:
        with caplog.at_level(logging.WARNING, logger="coordinator.server"):
            kept = [gate.accepted(ours.fileno()) for ours, _ in pairs]
        assert kept == [True, True, False]
        assert counters["refused.connections.frontend"] == 1
        assert "socket frontend is at its budget of 2" in caplog.text
        # The refused connection's peer sees it closed; the kept ones do not.
        refused_peer = pairs[2][1]
        refused_peer.settimeout(1.0)
        assert refused_peer.recv(1) == b""
        pairs[0][1].setblocking(False)
        with pytest.raises(BlockingIOError):
            pairs[0][1].recv(1)
        # A closed connection frees its place.
        gate.disconnected(pairs[0][0].fileno())
        gate.disconnected(pairs[2][0].fileno())
        extra = socket.socketpair()
        pairs.append(extra)
        assert gate.accepted(extra[0].fileno())
    finally:
        for ours, theirs in pairs:
            ours.close()
            theirs.close()
