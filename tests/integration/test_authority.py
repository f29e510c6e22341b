"""Operator authority through the real process: who may change membership, and resize bounds.

An anonymous connection to the frontend socket (on ipc, and on tcp loopback
without CURVE) used to cordon and drain ranks; `SCALE_ELASTIC_EP` from any
connection to `front_publish` resized the group to 65,536 ranks.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.auth

from coordinator._zmq import configure_client_socket
from coordinator.protocol import frontend as fp
from tests import vllm_peers as peers
from tests.conftest import CoordinatorFactory

Ctx = zmq.Context[zmq.Socket[bytes]]
STEP = 5.0


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coordinator", *args],
                          capture_output=True, text=True, timeout=60)


def call(ctx: Ctx, address: str, message: fp.FrontendRequest,
         keys: tuple[str, str] | None = None) -> fp.FrontendReply:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        if keys is not None:
            configure_client_socket(sock, *keys)
        sock.connect(address)
        sock.send(fp.encode(message))
        assert sock.poll(int(STEP * 1000)), f"no answer to {message!r}"
        return fp.decode_reply(sock.recv())
    finally:
        sock.close(0)


def group_state(ctx: Ctx, addresses: dict[str, str]) -> fp.GroupState:
    reply = call(ctx, addresses["frontend"], fp.QueryState(1))
    assert isinstance(reply, fp.StateReply)
    return reply.state


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_an_anonymous_frontend_connection_cannot_cordon_or_drain(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx, transport: str,
) -> None:
    handle = coordinator(2, transport=transport)
    engines = peers.handshake_group(zmq_ctx, handle.addresses, [0, 1], dp_size=2)
    for index, command in enumerate(("cordon", "drain", "cordon", "uncordon")):
        reply = call(zmq_ctx, handle.addresses["frontend"], fp.Admin(index + 1, command, 1))
        assert isinstance(reply, fp.ErrorReply), reply
        assert reply.code == fp.ERR_NOT_AUTHORIZED
        assert f"`dp-coordinator {command}`" in reply.message
    state = group_state(zmq_ctx, handle.addresses)
    assert [engine.state for engine in state.engines] == ["ready", "ready"]
    assert state.counters["refused.admin.not_authorized"] == 4

    # The operator, on the coordinator's host as its user: the owner-only admin socket.
    admin = handle.addresses["admin"]
    path = admin[len("ipc://"):]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert path.endswith("/admin.d/admin" if transport == "ipc" else "/admin")
    done = run_cli("cordon", "1", "--addr-file", handle.addr_file)
    assert done.returncode == 0, done.stderr
    assert "dp_rank=1 is now cordoned" in done.stdout
    out_of_range = run_cli("cordon", "9", "--addr-file", handle.addr_file)
    assert out_of_range.returncode == 1
    assert ("dp_rank=9 is not one of this coordinator's ranks (0..1); `dp-coordinator status` "
            "lists them") in out_of_range.stderr
    assert [e.state for e in group_state(zmq_ctx, handle.addresses).engines] == [
        "ready", "cordoned"]
    for engine in engines:
        engine.close()


def test_scale_elastic_ep_out_of_bounds_is_refused_and_counted(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx,
) -> None:
    handle = coordinator(2)
    engines = peers.handshake_group(zmq_ctx, handle.addresses, [0, 1], dp_size=2)
    frontend = peers.RawFrontend(zmq_ctx, handle.addresses)
    frontend.subscribe_publishes()
    for count in (65536, 3, 1):
        frontend.send_upstream(peers.scale_elastic_ep(count))
    deadline = time.monotonic() + STEP
    while (state := group_state(zmq_ctx, handle.addresses)).counters.get(
            "refused.front_publish.scale_out_of_range", 0) < 3:
        assert time.monotonic() < deadline, state.counters
        time.sleep(0.05)
    assert state.rank_count == 2 and len(state.engines) == 2
    counts, _, _ = msgspec.msgpack.decode(frontend.next_full_publish())
    assert len(counts) == 2
    frontend.close()
    for engine in engines:
        engine.close()


def test_scale_elastic_ep_within_the_bounds_resizes(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx,
) -> None:
    handle = coordinator(2, extra_args=["--min-engines", "1", "--max-engines", "4"])
    frontend = peers.RawFrontend(zmq_ctx, handle.addresses)
    frontend.subscribe_publishes()
    frontend.send_upstream(peers.scale_elastic_ep(4))
    deadline = time.monotonic() + STEP
    while group_state(zmq_ctx, handle.addresses).rank_count != 4:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    frontend.close()


def test_over_curve_only_an_admin_key_may_change_membership(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx, tmp_path: Path,
) -> None:
    keys = tmp_path / "keys"
    clients, admins = tmp_path / "clients", tmp_path / "admins"
    for directory in (keys, clients, admins):
        directory.mkdir()
    server_public, server_secret = zmq.auth.create_certificates(str(keys), "coordinator")
    frontend_public, frontend_secret = zmq.auth.create_certificates(str(keys), "frontend")
    admin_public, admin_secret = zmq.auth.create_certificates(str(keys), "operator")
    os.rename(frontend_public, clients / "frontend.key")
    os.rename(admin_public, admins / "operator.key")
    handle = coordinator(2, transport="tcp", extra_args=[
        "--curve-secret-key", server_secret, "--curve-clients-dir", str(clients),
        "--admin-keys-dir", str(admins)])
    address = handle.addresses["frontend"]

    refused = call(zmq_ctx, address, fp.Admin(1, "cordon", 0),
                   (frontend_secret, server_public))
    assert isinstance(refused, fp.ErrorReply) and refused.code == fp.ERR_NOT_AUTHORIZED
    # The operator's key is let in (it is not among the client keys) and recognised;
    # no engine holds rank 0, so the command is refused on its merits, not for authority.
    answered = call(zmq_ctx, address, fp.Admin(2, "cordon", 0), (admin_secret, server_public))
    assert isinstance(answered, fp.ErrorReply) and answered.code == fp.ERR_ADMIN_REFUSED
    assert "no live engine holds it" in answered.message
    # The command line with the operator's key goes over the frontend socket.
    done = run_cli("cordon", "1", "--addr-file", handle.addr_file, "--curve-secret-key",
                   admin_secret, "--curve-server-key", server_public)
    assert done.returncode == 1 and "no live engine holds it" in done.stderr, done.stderr
