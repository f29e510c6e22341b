"""coordinator._zmq on real sockets and processes: roles, CURVE, the loop, children, files."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from coordinator._zmq import (
    CLIENT,
    COLLECTIVE,
    ENGINE,
    OUTPUTS,
    PARENT_DEATH_SIGNAL,
    AddressFileTimeout,
    CurveClientKeys,
    SocketRole,
    bind,
    connect,
    die_with_parent_preexec,
    read_address_file,
    run_loop,
    wait_for_address_file,
)
from coordinator.cli.keygen import generate_keypair
from coordinator.server.curve import CurveServer

pytestmark = pytest.mark.timeout(30)

WAIT_S = 5.0
LIBZMQ_DEFAULT_HWM = 1000

Ctx = zmq.Context[zmq.Socket[bytes]]


@pytest.fixture
def ctx() -> Iterator[Ctx]:
    context: Ctx = zmq.Context()
    try:
        yield context
    finally:
        context.destroy(linger=0)


def options(sock: zmq.Socket[Any]) -> tuple[int, int, int]:
    return (int(sock.getsockopt(zmq.SNDHWM)), int(sock.getsockopt(zmq.RCVHWM)),
            int(sock.getsockopt(zmq.LINGER)))


def has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


# ---- roles ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("role", "socket_type", "expected"), [
    # vLLM's rule: no mark on point-to-point sockets, the default on the XSUB;
    # linger None is libzmq's default for the socket type.
    (ENGINE, zmq.PUSH, (0, LIBZMQ_DEFAULT_HWM, None)),
    (ENGINE, zmq.DEALER, (0, 0, None)),
    (ENGINE, zmq.XSUB, (LIBZMQ_DEFAULT_HWM, LIBZMQ_DEFAULT_HWM, None)),
    (CLIENT, zmq.DEALER, (LIBZMQ_DEFAULT_HWM, LIBZMQ_DEFAULT_HWM, 0)),
    (CLIENT, zmq.XSUB, (LIBZMQ_DEFAULT_HWM, LIBZMQ_DEFAULT_HWM, 0)),
    (OUTPUTS, zmq.PULL, (LIBZMQ_DEFAULT_HWM, 0, 0)),
    (COLLECTIVE, zmq.DEALER, (0, 0, 0)),
    (COLLECTIVE, zmq.ROUTER, (0, 0, 0)),
])
def test_each_role_sets_its_documented_options(
    ctx: Ctx, tmp_path: Path, role: SocketRole, socket_type: int,
    expected: tuple[int, int, int | None],
) -> None:
    sndhwm, rcvhwm, linger = expected
    if linger is None:
        fresh = ctx.socket(socket_type)
        linger = int(fresh.getsockopt(zmq.LINGER))
        fresh.close(0)
    sock = connect(ctx, socket_type, f"ipc://{tmp_path}/peer", role)
    try:
        assert options(sock) == (sndhwm, rcvhwm, linger)
        assert sock.getsockopt(zmq.IPV6) == 0
    finally:
        sock.close(0)


def test_identity_and_a_per_socket_linger_override_the_role(ctx: Ctx, tmp_path: Path) -> None:
    sock = connect(ctx, zmq.DEALER, f"ipc://{tmp_path}/peer", ENGINE, identity=b"\x03\x00",
                   linger_ms=4000)
    try:
        assert sock.getsockopt(zmq.IDENTITY) == b"\x03\x00"
        assert options(sock) == (0, 0, 4000)
    finally:
        sock.close(0)


def test_bind_resolves_the_port_and_connect_reaches_it(ctx: Ctx) -> None:
    pull, endpoint = bind(ctx, zmq.PULL, "tcp://127.0.0.1:0", OUTPUTS)
    push = connect(ctx, zmq.PUSH, endpoint, ENGINE, linger_ms=0)
    try:
        assert endpoint.startswith("tcp://127.0.0.1:") and not endpoint.endswith(":0")
        push.send(b"output")
        assert pull.poll(int(WAIT_S * 1000))
        assert pull.recv() == b"output"
    finally:
        push.close(0)
        pull.close(0)


@pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback here")
def test_a_bracketed_ipv6_endpoint_works_for_every_role(ctx: Ctx) -> None:
    router, endpoint = bind(ctx, zmq.ROUTER, "tcp://[::1]:0", COLLECTIVE)
    dealer = connect(ctx, zmq.DEALER, endpoint, CLIENT)
    try:
        assert endpoint.startswith("tcp://[::1]:")
        assert router.getsockopt(zmq.IPV6) == dealer.getsockopt(zmq.IPV6) == 1
        dealer.send(b"hi")
        assert router.poll(int(WAIT_S * 1000))
        assert router.recv_multipart()[1] == b"hi"
    finally:
        dealer.close(0)
        router.close(0)


def test_a_failed_bind_raises_and_leaves_no_socket_behind(ctx: Ctx) -> None:
    first, endpoint = bind(ctx, zmq.PULL, "tcp://127.0.0.1:0", OUTPUTS)
    try:
        with pytest.raises(zmq.ZMQError):
            bind(ctx, zmq.PULL, endpoint, OUTPUTS)
        with pytest.raises(zmq.ZMQError):
            connect(ctx, zmq.DEALER, "nonsense://x", CLIENT)
    finally:
        first.close(0)
    # Every socket was closed, so the context ends at once instead of waiting for one.
    done = threading.Event()
    threading.Thread(target=lambda: (ctx.term(), done.set()), daemon=True).start()
    assert done.wait(WAIT_S)


# ---- CURVE ---------------------------------------------------------------------------------


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, str]:
    server_pub, server_secret = generate_keypair(str(tmp_path / "server"), "coordinator")
    client_pub, client_secret = generate_keypair(str(tmp_path / "client"), "frontend0")
    clients = tmp_path / "clients"
    clients.mkdir()
    (clients / "frontend0.key").write_bytes(Path(client_pub).read_bytes())
    return {"server_public": server_pub, "server_secret": server_secret,
            "client_secret": client_secret, "clients_dir": str(clients)}


def test_curve_client_keys_connect_to_a_curve_server_over_tcp(
    ctx: Ctx, keys: dict[str, str]
) -> None:
    curve = CurveClientKeys.from_options(keys["client_secret"], keys["server_public"])
    assert curve is not None
    with CurveServer(ctx, keys["server_secret"], keys["clients_dir"]) as server:
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        server.configure_socket(router)
        router.bind("tcp://127.0.0.1:0")
        endpoint = router.getsockopt(zmq.LAST_ENDPOINT)
        assert isinstance(endpoint, bytes)
        plain = connect(ctx, zmq.DEALER, endpoint.decode(), CLIENT)
        dealer = connect(ctx, zmq.DEALER, endpoint.decode(), CLIENT, curve=curve)
        try:
            plain.send(b"no keys")
            dealer.send(b"with keys")
            assert router.poll(int(WAIT_S * 1000))
            assert router.recv_multipart()[1] == b"with keys"
            assert not router.poll(300)
        finally:
            plain.close(0)
            dealer.close(0)
            router.close(0)


def test_curve_client_keys_leave_ipc_sockets_plain(
    ctx: Ctx, keys: dict[str, str], tmp_path: Path
) -> None:
    curve = CurveClientKeys.from_options(keys["client_secret"], keys["server_public"])
    pull, endpoint = bind(ctx, zmq.PULL, f"ipc://{tmp_path}/plain", OUTPUTS)
    push = connect(ctx, zmq.PUSH, endpoint, ENGINE, linger_ms=0, curve=curve)
    try:
        assert push.getsockopt(zmq.MECHANISM) == zmq.NULL
        push.send(b"plain ipc")
        assert pull.poll(int(WAIT_S * 1000))
        assert pull.recv() == b"plain ipc"
    finally:
        push.close(0)
        pull.close(0)


def test_curve_client_keys_want_both_files_and_read_them_at_once(
    keys: dict[str, str], tmp_path: Path
) -> None:
    assert CurveClientKeys.from_options(None, None) is None
    with pytest.raises(ValueError, match="both"):
        CurveClientKeys.from_options(keys["client_secret"], None)
    with pytest.raises(ValueError, match="only a public key"):
        CurveClientKeys.from_options(keys["server_public"], keys["server_public"])
    with pytest.raises(ValueError, match="cannot read key file"):
        CurveClientKeys.from_options(keys["client_secret"], str(tmp_path / "missing.key"))


# ---- the event loop ------------------------------------------------------------------------


async def answer_after_leaving_a_task(cancelled: list[str]) -> int:
    async def linger() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(type(asyncio.get_running_loop()).__module__)
            raise

    asyncio.get_running_loop().create_task(linger())
    await asyncio.sleep(0)
    return 42


@pytest.mark.parametrize("loop", ["auto", "uvloop", "asyncio"])
def test_run_loop_returns_the_result_and_cancels_what_is_left(loop: str) -> None:
    cancelled: list[str] = []
    assert run_loop(answer_after_leaving_a_task(cancelled), loop) == 42
    assert len(cancelled) == 1
    assert cancelled[0].startswith("asyncio" if loop == "asyncio" else "uvloop")


def test_run_loop_refuses_an_unknown_loop_without_running_main() -> None:
    main = answer_after_leaving_a_task([])
    with pytest.raises(ValueError, match="auto, uvloop, asyncio"):
        run_loop(main, "trio")
    assert main.cr_frame is None  # closed, so never "was never awaited"


def test_run_loop_says_when_uvloop_was_asked_for_but_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # makes `import uvloop` fail
    main = answer_after_leaving_a_task([])
    with pytest.raises(RuntimeError, match="uvloop is not installed"):
        run_loop(main, "uvloop")
    assert main.cr_frame is None
    cancelled: list[str] = []
    assert run_loop(answer_after_leaving_a_task(cancelled), "auto") == 42
    assert len(cancelled) == 1 and cancelled[0].startswith("asyncio")


# ---- children ------------------------------------------------------------------------------

# A parent that starts a child with the helper, prints the child's pid, and then
# waits to be killed; the child records the signal it gets.
_PARENT = """
import subprocess, sys
from coordinator._zmq import die_with_parent_preexec
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]],
                         preexec_fn=die_with_parent_preexec())
print(child.pid, flush=True)
child.wait()
"""
_CHILD = """
import signal, sys, time
path = sys.argv[1]
def record(signum, frame):
    with open(path, "w") as handle:
        handle.write(signal.Signals(signum).name)
    sys.exit(0)
signal.signal(signal.SIGTERM, record)
with open(path + ".up", "w"):
    pass
time.sleep(30)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux only")
def test_a_child_gets_sigterm_when_its_parent_dies(tmp_path: Path) -> None:
    assert PARENT_DEATH_SIGNAL == signal.SIGTERM
    record = tmp_path / "signal"
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, _CHILD, str(record)],
                              stdout=subprocess.PIPE, text=True)
    child_pid = 0
    try:
        assert parent.stdout is not None
        child_pid = int(parent.stdout.readline())
        deadline = time.monotonic() + WAIT_S
        while not Path(f"{record}.up").exists():
            assert time.monotonic() < deadline, "the child never started"
            time.sleep(0.02)
        parent.kill()
        parent.wait(WAIT_S)
        while not record.exists() or not record.read_text():
            assert time.monotonic() < deadline + WAIT_S, "the child got no signal"
            time.sleep(0.02)
        assert record.read_text() == "SIGTERM"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(WAIT_S)
        if child_pid and not record.exists():
            os.kill(child_pid, signal.SIGKILL)


def test_die_with_parent_preexec_is_a_callable_on_linux() -> None:
    preexec = die_with_parent_preexec()
    assert (preexec is not None) is (sys.platform == "linux")


# ---- the address file ----------------------------------------------------------------------

KEYS = ("handshake", "frontend")


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def test_read_address_file_wants_whole_json_with_every_key(tmp_path: Path) -> None:
    path = tmp_path / "addresses.json"
    assert read_address_file(str(path), KEYS) is None
    for partial in ('{"handshake": "ipc:///h"', '["handshake", "frontend"]',
                    '{"handshake": "ipc:///h"}', "\udcff"):
        path.write_text(partial, encoding="utf-8", errors="surrogateescape")
        assert read_address_file(str(path), KEYS) is None, partial
    path.write_text(json.dumps({"handshake": "ipc:///h", "frontend": "ipc:///f", "x": 1}))
    assert read_address_file(str(path), KEYS) == {
        "handshake": "ipc:///h", "frontend": "ipc:///f", "x": "1"}


def test_wait_for_address_file_returns_once_the_file_is_complete(tmp_path: Path) -> None:
    path = tmp_path / "addresses.json"

    def writer() -> None:
        time.sleep(0.1)
        write_atomically(path, json.dumps({"handshake": "ipc:///h"}))
        time.sleep(0.1)
        write_atomically(path, json.dumps({"handshake": "ipc:///h", "frontend": "ipc:///f"}))

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        started = time.monotonic()
        addresses = wait_for_address_file(str(path), KEYS, WAIT_S)
        assert addresses == {"handshake": "ipc:///h", "frontend": "ipc:///f"}
        assert time.monotonic() - started >= 0.15
    finally:
        thread.join(WAIT_S)


def test_wait_for_address_file_times_out_with_the_path(tmp_path: Path) -> None:
    path = tmp_path / "addresses.json"
    path.write_text(json.dumps({"handshake": "ipc:///h"}))
    started = time.monotonic()
    with pytest.raises(AddressFileTimeout, match=f"no usable address file at {path} after 0.2 s"):
        wait_for_address_file(str(path), KEYS, 0.2)
    assert 0.2 <= time.monotonic() - started < WAIT_S


def test_wait_for_address_file_stops_when_the_check_raises(tmp_path: Path) -> None:
    looks: list[float] = []

    def check() -> None:
        looks.append(time.monotonic())
        if len(looks) == 3:
            raise ChildProcessError("the coordinator exited")

    with pytest.raises(ChildProcessError, match="exited"):
        wait_for_address_file(str(tmp_path / "never.json"), KEYS, WAIT_S, poll_s=0.01,
                              check=check)
    assert len(looks) == 3
