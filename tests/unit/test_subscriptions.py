"""The subscription guard on a real XPUB: the empty topic passes, any other closes its
connection and is counted, and a legitimate subscriber beside it is left alone."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq

from coordinator.server.connection_gate import ConnectionGate
from coordinator.server.subscriptions import SubscriptionGuard
from coordinator.server.transport import source_fd

Ctx = zmq.Context[zmq.Socket[bytes]]


@pytest.fixture
def ctx() -> Iterator[Ctx]:
    context: Ctx = zmq.Context()
    yield context
    context.destroy(linger=0)


def test_only_the_empty_topic_is_passed_on_and_an_other_one_closes_its_connection(
    ctx: Ctx,
) -> None:
    gate = ConnectionGate(1, 0, 5.0, time.monotonic)
    guard = SubscriptionGuard(gate, 5.0, time.monotonic)
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.XPUB_VERBOSE, 1)
    gate.attach("front_publish", pub, monitored=False)
    pub.bind("tcp://127.0.0.1:0")
    endpoint = pub.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(endpoint, bytes)
    passed: list[list[bytes]] = []
    handle = guard.guarded({"front_publish": passed.append})["front_publish"]
    note = guard.source("front_publish")
    assert note is not None and guard.source("frontend") is None

    def deliver(timeout: float = 5.0) -> None:
        assert pub.poll(int(timeout * 1000)), "nothing arrived"
        frame = pub.recv(copy=False)
        note(source_fd(frame))
        handle([frame.bytes])

    monitor = ctx.socket(zmq.XSUB)  # a legitimate subscriber
    monitor.setsockopt(zmq.LINGER, 0)
    monitor.connect(endpoint.decode())
    monitor.send(b"\x01")
    deliver()
    assert passed == [[b"\x01"]]

    hostile = ctx.socket(zmq.XSUB)
    hostile.setsockopt(zmq.LINGER, 0)
    hostile.setsockopt(zmq.RECONNECT_IVL, 60_000)  # stays closed once closed
    hostile.connect(endpoint.decode())
    hostile.send(b"\x01" + b"t" * 100)
    deliver()
    assert passed == [[b"\x01"]]
    assert guard.counters() == {"refused.subscriptions.front_publish": 1}

    # Its connection is closed (libzmq reports the close on the monitor), the other one
    # still gets what is published.
    kept = gate.sockets["front_publish"].kept
    deadline = time.monotonic() + 5.0
    while len(kept) != 1 and time.monotonic() < deadline:
        gate.read_monitor("front_publish")
        time.sleep(0.01)
    assert len(kept) == 1
    pub.send(b"rows")
    assert monitor.poll(5000) and monitor.recv() == b"rows"
    assert not hostile.poll(200)
    gate.close()
