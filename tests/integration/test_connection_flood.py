"""Connection floods through the real process: the descriptors libzmq needs stay free.

A peer that opens connections and never greets costs the coordinator a
descriptor each. Past the open-file limit libzmq aborts the process over ipc
(``Too many open files (src/ipc_listener.cpp)``) and spins its I/O thread over
tcp. Here the coordinator runs under a limit of 2,048 (soft and hard) and a
raw peer opens three times as many connections to its ``frontend`` socket:
the process must live, keep its descriptors below the limit, refuse (and
count) the connections past the socket's budget, handshake an engine on its
other sockets during the flood, and answer a frontend once the flood is gone.
Over tcp the process's CPU time during the flood is measured too.
"""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from coordinator._zmq import wait_for_address_file
from coordinator.protocol.addresses import SOCKET_KEYS
from coordinator.protocol.vllm import READY
from coordinator.server.connection_gate import connection_budgets
from tests.vllm_peers import RawEngine, RawFrontend, wait_until

Ctx = zmq.Context[zmq.Socket[bytes]]

LIMIT = 2048
FLOOD = 3 * LIMIT
FLOOD_DEADLINE_S = 30.0
HOLD_S = 3.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


Served = tuple[subprocess.Popen[bytes], dict[str, str], Path]


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[[str], Served]]:
    started: list[subprocess.Popen[bytes]] = []

    def start(transport: str) -> Served:
        def lower() -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, LIMIT))

        where = (["--host", "127.0.0.1"] if transport == "tcp"
                 else ["--ipc-dir", str(tmp_path / "ipc")])
        log_path = tmp_path / "serve.log"
        with open(log_path, "wb") as log_file:
            process = subprocess.Popen(
                [sys.executable, "-m", "coordinator", "serve", "--engines", "1",
                 "--addr-file", str(tmp_path / "addr.json"), *where],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log_file,
                preexec_fn=lower)
        started.append(process)

        def alive() -> None:
            assert process.poll() is None, log_path.read_text()

        addresses = wait_for_address_file(str(tmp_path / "addr.json"), SOCKET_KEYS, 30.0,
                                          check=alive)
        return process, addresses, log_path

    yield start
    for process in started:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)


def open_descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def cpu_seconds(pid: int) -> float:
    # Fields after the command's closing parenthesis; utime and stime are 14 and 15.
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def flood(address: str, count: int, pid: int) -> tuple[list[socket.socket], int]:
    """Open ``count`` connections that never greet; returns them and the peak number of
    descriptors the coordinator held meanwhile."""
    if address.startswith("ipc://"):
        family, target = socket.AF_UNIX, address[len("ipc://"):]
        where: str | tuple[str, int] = target
    else:
        host, port = address[len("tcp://"):].rsplit(":", 1)
        family, where = socket.AF_INET, (host, int(port))
    held: list[socket.socket] = []
    peak = 0
    deadline = time.monotonic() + FLOOD_DEADLINE_S
    while len(held) < count and time.monotonic() < deadline:
        peer = socket.socket(family, socket.SOCK_STREAM)
        peer.setblocking(False)
        try:
            peer.connect(where)
        except BlockingIOError:
            if family == socket.AF_UNIX:  # its backlog is full: try again
                peer.close()
                peak = max(peak, open_descriptors(pid))
                continue
        except OSError:
            peer.close()
            continue
        held.append(peer)
        if len(held) % 64 == 0:
            peak = max(peak, open_descriptors(pid))
    return held, peak


def close_all(peers: list[socket.socket]) -> None:
    for peer in peers:
        with contextlib.suppress(OSError):
            peer.close()


def need_descriptors_here() -> None:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < FLOOD + 256:
        pytest.skip(f"this test's own flood needs more than the soft limit here ({soft})")


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_a_connection_flood_past_the_limit_is_refused_and_the_group_served(
    serve: Callable[[str], Served], zmq_ctx: Ctx, transport: str
) -> None:
    need_descriptors_here()
    process, addresses, log_path = serve(transport)
    budget = connection_budgets(LIMIT, 1, 0)["frontend"]
    idle = open_descriptors(process.pid)
    cpu_before, started = cpu_seconds(process.pid), time.monotonic()
    peers, peak = flood(addresses["frontend"], FLOOD, process.pid)
    try:
        assert process.poll() is None, log_path.read_text()
        # Held for a while: libzmq must neither abort nor spin meanwhile.
        hold_until = time.monotonic() + HOLD_S
        while time.monotonic() < hold_until:
            peak = max(peak, open_descriptors(process.pid))
            assert process.poll() is None, log_path.read_text()
            time.sleep(0.05)
        cpu = (cpu_seconds(process.pid) - cpu_before) / (time.monotonic() - started)
        print(f"\n{transport}: {len(peers)} connections opened, coordinator descriptors "
              f"idle {idle}, peak {peak} (limit {LIMIT}, frontend budget {budget}), "
              f"CPU {cpu:.2f} of a core over the flood")
        assert len(peers) > LIMIT, "the flood did not even pass the limit"
        assert peak < LIMIT
        # libzmq at its limit takes a whole core (tcp) or aborts (ipc).
        assert cpu < 0.9
        # An engine connects to the four other sockets during the flood.
        engine = RawEngine(zmq_ctx, addresses, 0, dp_size=1)
        engine.hello()
        engine.connect_plane()
        engine.subscribe()
        engine.greet()
        assert engine.expect_publish(10.0) == [READY]
        engine.send_ready()
    finally:
        close_all(peers)
    assert process.poll() is None, log_path.read_text()
    frontend = RawFrontend(zmq_ctx, addresses)
    counters: dict[str, int] = {}

    def refusals_counted() -> bool:
        counters.update(frontend.counters())
        return counters.get("refused.connections.frontend", 0) > 0

    # The state reply (a frontend served after the flood) counts what was refused.
    wait_until(refusals_counted, timeout=20.0, what="refused.connections.frontend counted")
    state = frontend.state()
    assert [row[1] for row in state["engines"]] == ["ready"]
    print(f"refused.connections.frontend = {counters['refused.connections.frontend']}")
    text = log_path.read_text()
    assert "socket frontend is at its budget" in text
    assert "Too many open files" not in text
