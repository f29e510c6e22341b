"""The sandbox itself: hosts reach each other, a partition cuts one off, teardown is total."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.netns import sandbox as sandbox_module
from tests.netns.sandbox import Sandbox

pytestmark = [pytest.mark.netns, pytest.mark.timeout(60)]

REPO = str(Path(__file__).resolve().parents[2])

# A line-echo TCP server (a thread per connection): prints "listening" once bound.
ECHO_SERVER = """
import socketserver, sys
class Echo(socketserver.StreamRequestHandler):
    def handle(self):
        for line in self.rfile:
            self.wfile.write(line); self.wfile.flush()
socketserver.ThreadingTCPServer.daemon_threads = True
server = socketserver.ThreadingTCPServer((sys.argv[1], int(sys.argv[2])), Echo)
print("listening", flush=True)
server.serve_forever()
"""

# Connects, exchanges a line, then (on "go" from stdin) sends another and reports
# how long its echo took; each step bounded by its own timeout.
ECHO_CLIENT = """
import socket, sys, time
host, port = sys.argv[1], int(sys.argv[2])
try:
    conn = socket.create_connection((host, port), timeout=1.0)
except OSError as exc:
    print("connect-failed", type(exc).__name__, flush=True); sys.exit(0)
conn.settimeout(15.0)
f = conn.makefile("rwb")
f.write(b"one\\n"); f.flush()
print("echo", f.readline().decode().strip(), flush=True)
sys.stdin.readline()
start = time.monotonic()
f.write(b"two\\n"); f.flush()
print("echo", f.readline().decode().strip(), round(time.monotonic() - start, 2), flush=True)
"""


def _line(process: subprocess.Popen[bytes], timeout: float) -> str:
    """One line of the child's stdout, waiting at most `timeout`."""
    import select

    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    assert ready, f"no output within {timeout} s"
    return process.stdout.readline().decode().strip()


def _connect_once(sandbox: Sandbox, host: str, target: str) -> str:
    result = sandbox.run(host, [sys.executable, "-c", ECHO_CLIENT,
                                sandbox.address(target), "7000"], timeout=10.0)
    return result.stdout.splitlines()[0] if result.stdout else result.stderr


def test_partition_blackholes_a_host_and_heal_lets_its_connections_resume(
    sandbox: Sandbox,
) -> None:
    server = sandbox.popen("hosta", [sys.executable, "-c", ECHO_SERVER,
                                     sandbox.address("hosta"), "7000"],
                           stdout=subprocess.PIPE)
    assert _line(server, 10.0) == "listening"
    assert _connect_once(sandbox, "hostb", "hosta") == "echo one"

    # A connection opened before the partition outlives it, as on a real network.
    client = sandbox.popen("hostb", [sys.executable, "-c", ECHO_CLIENT,
                                     sandbox.address("hosta"), "7000"],
                           stdout=subprocess.PIPE, stdin=subprocess.PIPE)
    assert _line(client, 10.0) == "echo one"

    sandbox.partition("hostb")
    # New connections neither succeed nor get refused: the packets vanish.
    assert _connect_once(sandbox, "hostb", "hosta") == "connect-failed TimeoutError"
    assert _connect_once(sandbox, "coord", "hosta") == "echo one", "only hostb is cut off"
    assert client.stdin is not None
    sent_at = time.monotonic()
    client.stdin.write(b"go\n")
    client.stdin.flush()
    time.sleep(1.5)
    assert client.poll() is None, "the old connection was not reset by the partition"

    healed_at = sandbox.heal("hostb")
    reply = _line(client, 10.0).split()
    assert reply[:2] == ["echo", "two"], reply
    waited = float(reply[2])
    assert waited >= healed_at - sent_at - 0.2, "the line crossed while partitioned"
    if sandbox.rto_capped:
        # Resumed by the next retransmission, at most one capped back-off after the heal.
        assert waited <= healed_at - sent_at + sandbox.heal_delay_bound_s + 1.0
    assert _connect_once(sandbox, "hostb", "hosta") == "echo one"


def test_destroy_kills_every_process_and_removes_every_namespace(sandbox: Sandbox) -> None:
    started = sandbox.popen("hosta", ["sleep", "60"])
    # One the sandbox did not start itself: found through its namespace.
    stray = subprocess.run(
        ["ip", "netns", "exec", sandbox.namespace("hostb"), "sh", "-c",
         "sleep 60 >/dev/null 2>&1 & echo $!"],
        capture_output=True, text=True, timeout=10.0, check=True,
    )
    stray_pid = int(stray.stdout.strip())
    names = [sandbox.namespace(h) for h in [*sandbox.hosts, sandbox_module.SWITCH]]
    assert set(names) <= set(sandbox_module.list_namespaces())

    sandbox.destroy()

    assert started.poll() is not None
    assert not _alive(stray_pid)
    assert not set(names) & set(sandbox_module.list_namespaces())


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# A run that builds a sandbox with a process inside and then waits to be killed.
KILLED_RUN = """
import subprocess, sys, time
from tests.netns.sandbox import Sandbox
sb = Sandbox.create(["h1"])
sleeper = subprocess.Popen(["ip", "netns", "exec", sb.namespace("h1"), "sleep", "60"],
                           start_new_session=True)
print(sb.tag, sleeper.pid, flush=True)
time.sleep(60)
"""


def test_a_killed_runs_leftovers_are_removed_by_the_next_run(netns_ready: None,
                                                              tmp_path: Path) -> None:
    run = subprocess.Popen([sys.executable, "-c", KILLED_RUN], cwd=REPO,
                           stdout=subprocess.PIPE, start_new_session=True)
    try:
        tag, sleeper = _line(run, 20.0).split()
    finally:
        os.kill(run.pid, signal.SIGKILL)
        run.wait(10)
    leftovers = [n for n in sandbox_module.list_namespaces() if n.startswith(f"{tag}-")]
    assert sorted(leftovers) == [f"{tag}-h1", f"{tag}-switch"]
    assert _alive(int(sleeper))

    removed = sandbox_module.sweep_stale()

    assert sorted(removed) == sorted(leftovers)
    assert not [n for n in sandbox_module.list_namespaces() if n.startswith(f"{tag}-")]
    deadline = time.monotonic() + 5.0
    while _alive(int(sleeper)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(int(sleeper)), "the process left inside was not killed"
