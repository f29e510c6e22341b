"""The open-file limit: raised at start-up to what the group needs, or a clear refusal.

Every engine connection is a descriptor; libzmq aborts the process over ipc
when it runs out (``Too many open files (src/ipc_listener.cpp)``). Here the
coordinator starts under a soft limit far below what its engines need and
must serve them all, or, when even the hard limit is too low, refuse to start
and say how many descriptors it needs and how to allow them.
"""

from __future__ import annotations

import resource
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from coordinator._zmq import wait_for_address_file
from coordinator.protocol.addresses import SOCKET_KEYS
from coordinator.server.fdlimit import (
    MIN_FRONTENDS,
    PER_ENGINE,
    PER_FRONTEND,
    RESERVE,
    descriptors_needed,
    ensure_descriptors,
)
from tests.vllm_peers import RawEngine, RawFrontend, handshake_group

Ctx = zmq.Context[zmq.Socket[bytes]]

ENGINES = 100
LOW_SOFT = 256  # what 100 engines handshaking at once (400 connections) do not fit in


def serve_under_limit(tmp_path: Path, soft: int, hard: int) -> subprocess.Popen[bytes]:
    def lower() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    (tmp_path / "ipc").mkdir()
    return subprocess.Popen(
        [sys.executable, "-m", "coordinator", "serve", "--engines", str(ENGINES),
         "--addr-file", str(tmp_path / "addr.json"), "--ipc-dir", str(tmp_path / "ipc")],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        preexec_fn=lower)


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)


def soft_limit_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError("no open-file limit in /proc")


def test_a_group_larger_than_the_soft_limit_holds_is_served(
    tmp_path: Path, zmq_ctx: Ctx, processes: list[subprocess.Popen[bytes]]
) -> None:
    needed = descriptors_needed(ENGINES, 0)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(f"the hard open-file limit here ({hard}) is below what {ENGINES} engines "
                    f"need ({needed})")
    if soft != resource.RLIM_INFINITY and soft < 4 * ENGINES + 64:
        pytest.skip(f"this test's own engines need more than the soft limit ({soft})")
    process = serve_under_limit(tmp_path, LOW_SOFT, hard)
    processes.append(process)

    def alive() -> None:
        assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""

    addresses = wait_for_address_file(str(tmp_path / "addr.json"), SOCKET_KEYS, 30.0,
                                      check=alive)
    assert soft_limit_of(process.pid) >= needed
    # Every rank handshakes at once: 4 connections each, over ipc.
    engines: list[RawEngine] = handshake_group(zmq_ctx, addresses, list(range(ENGINES)),
                                               dp_size=ENGINES)
    assert len(engines) == ENGINES
    alive()
    state = RawFrontend(zmq_ctx, addresses).state()
    assert [engine[1] for engine in state["engines"]] == ["ready"] * ENGINES
    alive()


def test_a_hard_limit_too_low_is_refused_with_what_to_do(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    needed = descriptors_needed(ENGINES, 0)
    process = serve_under_limit(tmp_path, 128, 128)
    processes.append(process)
    _, err = process.communicate(timeout=30)
    assert process.returncode == 2
    text = err.decode()
    assert f"need about {needed} open files" in text, text
    assert "at most 128" in text and f"ulimit -n {needed}" in text
    assert f"LimitNOFILE={needed}" in text
    assert not (tmp_path / "addr.json").exists()


def test_what_a_group_needs() -> None:
    assert descriptors_needed(1024, 3) == RESERVE + PER_ENGINE * 1024 + PER_FRONTEND * 16
    assert descriptors_needed(8, 40) == RESERVE + PER_ENGINE * 8 + PER_FRONTEND * 40
    assert MIN_FRONTENDS == 16
    # Even a group that fits gets the whole hard limit: peers may connect beyond the plan.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < descriptors_needed(1, 0):
        pytest.skip(f"the hard open-file limit here ({hard}) is below what one engine needs")
    check = ensure_descriptors(1, 0)
    assert check.refusal is None
    assert check.raised_to == (None if soft == hard else hard)
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
