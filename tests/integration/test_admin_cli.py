"""`dp-coordinator cordon | uncordon | drain` against a running coordinator."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import zmq

from tests.conftest import CoordinatorFactory
from tests.vllm_peers import RawFrontend, handshake_group, wait_until

Ctx = zmq.Context[zmq.Socket[bytes]]


def admin(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coordinator", *args],
                          capture_output=True, text=True, timeout=60)


def states(frontend: RawFrontend) -> list[str]:
    return [engine[1] for engine in frontend.state()["engines"]]


def test_cordon_uncordon_and_drain_from_the_command_line(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx
) -> None:
    handle = coordinator(2)
    engines = handshake_group(zmq_ctx, handle.addresses, [0, 1], dp_size=2)
    frontend = RawFrontend(zmq_ctx, handle.addresses)
    addr = ["--addr-file", handle.addr_file]

    done = admin("cordon", "1", *addr)
    assert done.returncode == 0, done.stderr
    assert "dp_rank=1 is now cordoned" in done.stdout
    assert states(frontend) == ["ready", "cordoned"]
    # A cordoned rank gets nothing new: every submit goes to rank 0.
    for index in range(3):
        reply = frontend.submit(f"r{index}", b"p")
        assert reply[0] == "submitted" and reply[3] == 0, reply

    refused = admin("cordon", "1", *addr)
    assert refused.returncode == 1
    assert "already cordoned" in refused.stderr

    assert admin("uncordon", "1", *addr).returncode == 0
    assert states(frontend) == ["ready", "ready"]

    # Drain a rank holding a request: --wait gives up while it is in flight ...
    reply = frontend.submit("held", b"p", wave=0, dp_rank=1)
    held_rank = reply[3]
    assert held_rank == 1, reply
    assert engines[held_rank].recv_dispatch(5.0) == [b"\x00", b"p"]
    still = admin("drain", str(held_rank), *addr, "--wait", "0.5")
    assert still.returncode == 1
    assert "still has 1 requests in flight" in still.stderr
    assert states(frontend)[held_rank] == "draining"
    # ... and reports the rank drained once the frontend says the request finished.
    frontend.send(msgspec.msgpack.encode(["finished", ["held"]]))
    wait_until(lambda: frontend.state()["engines"][held_rank][7] == 0, timeout=5.0)
    assert admin("uncordon", str(held_rank), *addr).returncode == 0
    drained = admin("drain", str(held_rank), *addr, "--wait", "5")
    assert drained.returncode == 0, drained.stderr
    assert f"dp_rank={held_rank} drained: no requests in flight" in drained.stdout
    assert states(frontend)[held_rank] == "draining"


def test_admin_on_a_rank_nobody_holds_is_refused_with_a_reason(
    coordinator: CoordinatorFactory,
) -> None:
    handle = coordinator(2)
    refused = admin("drain", "1", "--addr-file", handle.addr_file)
    assert refused.returncode == 1
    assert "no live engine holds it" in refused.stderr


def test_admin_without_a_coordinator_says_so(tmp_path: object) -> None:
    missing = admin("cordon", "0", "--addr-file", "/nonexistent/addresses.json")
    assert missing.returncode == 2
    assert "dp-coordinator cordon" in missing.stderr


def test_admin_finds_the_coordinator_without_addr_file_as_status_does(tmp_path: Path) -> None:
    base = tmp_path / "rpc"
    base.mkdir()
    addr = base / "dp-coordinator-test.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "coordinator", "serve", "--engines", "1",
         "--addr-file", str(addr)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while not addr.exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        done = subprocess.run([sys.executable, "-m", "coordinator", "cordon", "0"],
                              capture_output=True, text=True, timeout=60,
                              env={**os.environ, "VLLM_RPC_BASE_PATH": str(base)})
        # Nobody holds rank 0: the coordinator was found and refused with a reason.
        assert done.returncode == 1, done.stderr
        assert "refused" in done.stderr, done.stderr
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


def test_no_command_says_to_give_one_and_help_does_not_promise_a_default() -> None:
    done = subprocess.run([sys.executable, "-m", "coordinator"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "give a COMMAND" in done.stderr
    assert "default main job" not in done.stderr
