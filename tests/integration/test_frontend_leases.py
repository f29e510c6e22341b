"""Frontend registrations are leases, through the real process and the SDK.

Before: after 1,024 register-then-disconnect clients every new frontend was
refused for good, client index 0 stayed tied to a dead output address, and a
restarted coordinator without a state file never heard of its frontends again.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from coordinator.frontend import FrontendClient
from coordinator.launch import CoordinatorHandle, launch
from coordinator.protocol import frontend as fp
from tests import vllm_peers as peers
from tests.conftest import CoordinatorFactory

Ctx = zmq.Context[zmq.Socket[bytes]]
STEP = 5.0
TTL = ["--frontend-lease-ttl-s", "1"]


def dealer(ctx: Ctx, address: str) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def call(sock: zmq.Socket[bytes], message: fp.FrontendRequest) -> fp.FrontendReply:
    sock.send(fp.encode(message))
    assert sock.poll(int(STEP * 1000)), f"no answer to {message!r}"
    return fp.decode_reply(sock.recv())


def group_state(ctx: Ctx, address: str) -> fp.GroupState:
    sock = dealer(ctx, address)
    try:
        reply = call(sock, fp.QueryState(1))
        assert isinstance(reply, fp.StateReply)
        return reply.state
    finally:
        sock.close(0)


def wait_state(ctx: Ctx, address: str, check: object, what: str,
               timeout: float = STEP) -> fp.GroupState:
    deadline = time.monotonic() + timeout
    while True:
        state = group_state(ctx, address)
        if check(state):  # type: ignore[operator]
            return state
        assert time.monotonic() < deadline, f"{what}: {state.frontends} frontends, " \
            f"{state.counters}"
        time.sleep(0.05)


def test_1024_register_then_disconnect_clients_free_every_slot_and_index(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx,
) -> None:
    handle = coordinator(1, extra_args=TTL)
    address = handle.addresses["frontend"]
    gone = dealer(zmq_ctx, address)
    for index in range(1024):
        gone.send(fp.encode(fp.Register(index + 1, index, f"ipc:///tmp/gone-{index}")))
    replies = 0
    while replies < 1024 and gone.poll(int(STEP * 1000)):
        assert isinstance(fp.decode_reply(gone.recv()), fp.Registered)
        replies += 1
    assert replies == 1024
    assert group_state(zmq_ctx, address).frontends == 1024
    gone.close(0)

    state = wait_state(zmq_ctx, address, lambda s: s.frontends == 0, "leases expire")
    assert state.counters["frontend.expired"] == 1024
    fresh = dealer(zmq_ctx, address)
    # No INIT carried those addresses: index 0 is free for any address.
    assert isinstance(call(fresh, fp.Register(1, 0, "ipc:///tmp/fresh-0")), fp.Registered)
    beyond = call(fresh, fp.Register(2, 1024, "ipc:///tmp/fresh-1024"))
    assert isinstance(beyond, fp.ErrorReply)
    assert beyond.message == "client_index 1024 is outside 0..1023 (at most 1024 frontends)"
    fresh.close(0)


def test_an_index_an_init_carried_keeps_its_address_once_its_frontend_is_gone(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx,
) -> None:
    handle = coordinator(1, extra_args=TTL)
    address = handle.addresses["frontend"]
    first = dealer(zmq_ctx, address)
    assert isinstance(call(first, fp.Register(1, 0, "ipc:///tmp/dead-0")), fp.Registered)
    engine = peers.RawEngine(zmq_ctx, handle.addresses, 0)
    init = engine.hello()
    assert init["addresses"]["outputs"] == ["ipc:///tmp/dead-0"]
    first.close(0)
    wait_state(zmq_ctx, address, lambda s: s.frontends == 0, "the lease expires")

    second = dealer(zmq_ctx, address)
    moved = call(second, fp.Register(2, 0, "ipc:///tmp/elsewhere-0"))
    assert isinstance(moved, fp.ErrorReply) and moved.code == fp.ERR_BAD_CLIENT_INDEX
    assert "ipc:///tmp/dead-0, which engines already use" in moved.message
    assert isinstance(call(second, fp.Register(3, 0, "ipc:///tmp/dead-0")), fp.Registered)
    second.close(0)
    engine.close()


async def test_the_sdk_heartbeats_keep_its_registration(
    coordinator: CoordinatorFactory,
) -> None:
    handle = coordinator(1, extra_args=TTL)
    async with FrontendClient(handle.addresses, call_timeout_s=STEP) as client:
        await client.register()
        await asyncio.sleep(3.0)  # three lease TTLs
        state = await client.query_state()
        assert state.frontends == 1 and "frontend.expired" not in state.counters
        assert client.stats["heartbeats"] >= 3
        assert client.heartbeat_s == pytest.approx(1 / 3)


@pytest.fixture
def fixed_dir() -> Iterator[str]:
    directory = tempfile.mkdtemp(prefix="dpc-fl-")
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def start(directory: str, *extra: str) -> CoordinatorHandle:
    return launch(engines=1, addr_file=str(Path(directory) / "addresses.json"),
                  extra_args=["--ipc-dir", str(Path(directory) / "ipc"), *TTL, *extra],
                  timeout=20.0)


@pytest.mark.parametrize("state_file", [False, True])
async def test_the_sdk_registers_again_after_a_coordinator_restart(
    fixed_dir: str, state_file: bool,
) -> None:
    extra = ["--state-file", str(Path(fixed_dir) / "state.json")] if state_file else []
    handle = start(fixed_dir, *extra)
    try:
        client = FrontendClient(handle.addresses, client_index=3, call_timeout_s=1.0)
        await client.register()
        assert handle.shutdown(timeout=5.0) == 0
        handle = start(fixed_dir, *extra)
        deadline = time.monotonic() + STEP
        while True:
            try:
                state = await client.query_state()
            except Exception:
                state = None
            if state is not None and state.frontends == 1:
                break
            assert time.monotonic() < deadline, "the frontend is not registered again"
            await asyncio.sleep(0.1)
        # With a state file the registration was restored, and heartbeats renew it.
        assert client.stats["reregistered"] == (0 if state_file else 1)
        await client.close()
    finally:
        handle.shutdown(timeout=5.0)
