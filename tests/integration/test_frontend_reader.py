"""The batched ``frontend`` reader: bursts of requests read in one drain.

A real coordinator process takes bursts that a frontend wrote without waiting for
any reply, so that many messages wait on the socket at each wake-up; the checks
are on what the engines and the frontend receive. One drain is also run by hand
on a server bound in this process (real sockets), recording the order in which
the core is asked and its actions are carried out, to pin the rule that a
wave's first request is sent and its wake published before the next message of
its drain is even decided.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import pytest
import zmq

from coordinator.core.actions import Action, DispatchAdd, Publish, Send
from coordinator.core.coordinator import CoordinatorCore
from coordinator.core.events import Event, FrontendRequestReceived
from coordinator.protocol import frontend as fp
from coordinator.protocol import vllm
from coordinator.server.app import CoordinatorServer
from coordinator.server.config import ServerConfig
from coordinator.server.frontend_reader import FrontendReader
from coordinator.server.sending import poke_if_readable, send_routed
from tests.conftest import CoordinatorFactory
from tests.vllm_peers import (
    RawEngine,
    RawFrontend,
    handshake_group,
    pack,
    start_dp_wave_frames,
    unpack,
)

pytestmark = pytest.mark.timeout(120)

Ctx = zmq.Context[zmq.Socket[bytes]]
BURST = 200
encoder = msgspec.msgpack.Encoder()


def send_burst(front: RawFrontend, payloads: Sequence[bytes], prefix: str) -> list[int]:
    """Submit every payload without waiting for a reply; the call ids, in order."""
    call_ids = []
    for index, payload in enumerate(payloads):
        call_id = front.next_call_id()
        call_ids.append(call_id)
        front.send(pack(["submit", call_id, f"{prefix}-{index}", 0, None]), payload)
    return call_ids


def collect_adds(engines: Sequence[RawEngine], expected: int) -> dict[int, list[list[bytes]]]:
    adds: dict[int, list[list[bytes]]] = {engine.rank: [] for engine in engines}
    deadline = time.monotonic() + 30.0
    while sum(map(len, adds.values())) < expected and time.monotonic() < deadline:
        for engine in engines:
            frames = engine.recv_dispatch(0.01)
            if frames is not None:
                adds[engine.rank].append(frames)
    return adds


def test_a_burst_into_a_paused_group_wakes_it_once_and_every_request_arrives_intact(
        coordinator: CoordinatorFactory, zmq_ctx: Ctx) -> None:
    handle = coordinator(4)
    engines = handshake_group(zmq_ctx, handle.addresses, range(4), dp_size=4)
    front = RawFrontend(zmq_ctx, handle.addresses)
    # Distinct payloads, one of them 1 MB, so that a frame handed on to the wrong
    # ADD or cut short would show.
    payloads = [f"payload-{index}:".encode() * (1 + index % 7) for index in range(BURST)]
    payloads[BURST // 2] = b"\xab" * (1 << 20)
    call_ids = send_burst(front, payloads, "burst")

    replies = [front.recv(10.0) for _ in range(BURST)]
    assert [reply[1] for reply in replies] == call_ids, "replies come in call order"
    assert all(reply[0] == "submitted" for reply in replies), replies[:3]
    woke = [reply[2] for reply in replies if reply[4]]
    assert woke == ["burst-0"], f"only the first request wakes the group, got {woke}"
    chosen = replies[0][3]

    adds = collect_adds(engines, BURST)
    by_id = {reply[2]: reply[3] for reply in replies}
    seen = 0
    for rank, frames_list in adds.items():
        for frames in frames_list:
            assert frames[0] == vllm.ADD
            seen += 1
        got = [frames[1] for frames in frames_list]
        want = [payloads[index] for index in range(BURST) if by_id[f"burst-{index}"] == rank]
        assert got == want, f"rank {rank}: its ADDs, in order, with their payloads intact"
    assert seen == BURST
    assert adds[chosen][0][1] == payloads[0], "the waking request is its engine's first ADD"
    for engine in engines:
        wake = engine.expect_publish()
        assert wake[:1] == start_dp_wave_frames(0, None)[:1] and unpack(wake[1])[0] == 0, wake


def test_bad_and_oversize_messages_in_a_burst_are_refused_and_the_rest_served(
        coordinator: CoordinatorFactory, zmq_ctx: Ctx) -> None:
    handle = coordinator(2, extra_args=["--max-request-bytes", str(64 * 1024)])
    engines = handshake_group(zmq_ctx, handle.addresses, range(2), dp_size=2)
    front = RawFrontend(zmq_ctx, handle.addresses)
    ids = []
    for index in range(60):
        call_id = front.next_call_id()
        ids.append(call_id)
        if index % 3 == 1:
            # Past the bound in frames under it (a frame past it costs the connection):
            # refused as too large, with its call id.
            front.send(pack(["submit", call_id, f"big-{index}", 0, None]), b"x" * 40_000,
                       b"y" * 40_000)
        elif index % 3 == 2:  # a header that is not a request: refused with its call id
            front.send(pack(["submit", call_id]), b"p")
        else:
            front.send(pack(["submit", call_id, f"ok-{index}", 0, None]), b"fine")
    replies = [front.recv(10.0) for _ in ids]
    assert [reply[1] for reply in replies] == ids
    kinds = [reply[0] for reply in replies]
    assert kinds == ["submitted" if i % 3 == 0 else "error" for i in range(60)], kinds
    assert {reply[2] for i, reply in enumerate(replies) if i % 3 == 1} == {fp.ERR_TOO_LARGE}
    assert sum(map(len, collect_adds(engines, 20).values())) == 20


# ---- one drain, by hand -----------------------------------------------------------------------


class RecordingCore:
    """The real core, with each request it is asked about written down first."""

    def __init__(self, core: CoordinatorCore, log: list[tuple[str, Any]]) -> None:
        self._core = core
        self._log = log

    def __getattr__(self, name: str) -> Any:
        return getattr(self._core, name)

    def handle(self, event: Event, now: float) -> Sequence[Action]:
        if isinstance(event, FrontendRequestReceived):
            self._log.append(("decide", getattr(event.message, "request_id", None)))
        return self._core.handle(event, now)


def carried(actions: Sequence[Action]) -> list[str]:
    names: list[str] = []
    for action in actions:
        if isinstance(action, DispatchAdd):
            names.append(f"add:{action.retry.request_id}")
            names += [f"publish:{a.socket}" for a in action.wake if isinstance(a, Publish)]
            names.append(f"reply:{action.retry.request_id}")
        elif isinstance(action, Send):
            names.append(f"send:{action.socket}")
    return names


def test_a_first_request_is_sent_and_its_wake_published_before_the_drain_goes_on(
        tmp_path: os.PathLike[str], zmq_ctx: Ctx) -> None:
    server = CoordinatorServer(ServerConfig(engines=2, ipc_dir=os.path.join(tmp_path, "ipc")))
    server.bind()
    socks: list[zmq.Socket[bytes]] = []
    try:
        for rank in (0, 1):
            identity = rank.to_bytes(2, "little")
            for status in ("HELLO", "READY"):
                server.frame_handlers["handshake"]([identity, encoder.encode(
                    {"status": status, "local": True, "headless": True})])
            engine = zmq_ctx.socket(zmq.DEALER)
            engine.setsockopt(zmq.IDENTITY, identity)
            engine.connect(server.addresses["dispatch"])
            engine.send(b"greeting")
            socks.append(engine)
            sock = server.sock("dispatch")
            assert sock.poll(10_000)
            server.frame_handlers["dispatch"](sock.recv_multipart())
        for _ in (0, 1):
            server.frame_handlers["back_publish"]([vllm.SUBSCRIBE])
        front = zmq_ctx.socket(zmq.DEALER)
        front.connect(server.addresses["frontend"])
        socks.append(front)
        for index in range(5):
            front.send_multipart([fp.encode(fp.Submit(index + 1, f"r{index}", 0)), b"p"])
        frontend = server.sock("frontend")
        deadline = time.monotonic() + 10.0
        log: list[tuple[str, Any]] = []

        def run(actions: Sequence[Action]) -> None:
            log.append(("carry", carried(actions)))
            server._runner.run(actions)

        reader = FrontendReader(
            frontend, RecordingCore(server.core, log), run, server.settle,  # type: ignore[arg-type]
            clock=time.monotonic, on_error=lambda name, exc: log.append(("error", exc)),
            on_oversize=lambda kept, total, count: None, observe_decision=lambda s: None,
            max_message_bytes=1 << 20)
        read = 0
        while read < 5 and time.monotonic() < deadline:
            frontend.poll(100)
            read += reader.read_batch()
        assert read == 5
        assert log[0] == ("decide", "r0")
        assert log[1][0] == "carry"
        assert log[1][1][:3] == ["add:r0", "publish:back_publish", "reply:r0"], log[1]
        assert [entry for entry in log if entry[0] == "decide"] == [
            ("decide", f"r{index}") for index in range(5)]
        for position in range(0, 10, 2):
            assert log[position][0] == "decide" and log[position + 1][0] == "carry", log
        woke = [fp.decode_reply(front.recv()) for _ in range(5)]
        assert [reply.woke for reply in woke] == [True, False, False, False, False]  # type: ignore[union-attr]
    finally:
        for sock in socks:
            sock.close(0)
        server.close()


async def test_the_reader_reads_on_after_a_send_swallowed_its_read_edge(
        tmp_path: os.PathLike[str]) -> None:
    """A request arrives while the loop is busy, then a send on the same socket lets
    libzmq clear the FD: the look after the send (the server's ``settle``) pokes the
    reader, which reads the request; with nothing waiting it is not woken."""
    server = CoordinatorServer(ServerConfig(engines=2, ipc_dir=os.path.join(tmp_path, "ipc")))
    server.bind()
    ctx: Ctx = zmq.Context()
    client = ctx.socket(zmq.DEALER)
    client.setsockopt(zmq.IDENTITY, b"\x00fe-poke")
    client.connect(server.addresses["frontend"])
    router = server.sock("frontend")
    pokes: list[int] = []

    def settle() -> None:
        server.settle()
        poke_if_readable(router, lambda: (pokes.append(1), reader.poke()))

    reader = FrontendReader(
        router, server.core, server._runner.run, settle, clock=time.monotonic,
        on_error=lambda name, exc: None, on_oversize=lambda kept, total, count: None,
        observe_decision=lambda seconds: None, max_message_bytes=1 << 20)
    task = asyncio.ensure_future(reader.run())

    async def received(timeout: float = 10.0) -> bytes:
        deadline = time.monotonic() + timeout
        while not client.poll(0):
            assert time.monotonic() < deadline, "nothing arrived"
            await asyncio.sleep(0.01)
        return client.recv()

    try:
        client.send(fp.encode(fp.QueryState(1)))
        assert isinstance(fp.decode_reply(await received()), fp.StateReply)
        assert pokes == []  # the reply found nothing waiting: no wake-up
        client.send(fp.encode(fp.QueryState(2)))
        time.sleep(0.1)  # the loop is busy while libzmq signals the FD
        send_routed(router, b"\x00fe-poke", [b"a notice"])
        settle()
        assert pokes == [1]
        assert await received() == b"a notice"
        second = fp.decode_reply(await received())
        assert isinstance(second, fp.StateReply) and second.call_id == 2
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        client.close(0)
        ctx.term()
        server.close()
