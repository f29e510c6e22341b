"""Message size is bounded per message, all frames together, on every socket that reads.

Each test runs the real process with small bounds and sends real multi-frame
messages whose frames are each well under the bound but whose total is not:
libzmq's per-frame limit lets them through, so only the coordinator's own
count stops them. Nothing of a dropped message may stay referenced: the RSS
check reads /proc after the refusal.
"""

from __future__ import annotations

import asyncio
import tempfile
import time

import msgspec
import zmq

from coordinator.protocol import frontend as fp
from coordinator.protocol import vllm
from coordinator.server.transport import FrameReader
from tests.conftest import CoordinatorFactory

Ctx = zmq.Context[zmq.Socket[bytes]]
MIB = 1024 * 1024
STEP = 5.0


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS line")


def dealer(ctx: Ctx, address: str, identity: bytes | None = None) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(address)
    return sock


def reply(sock: zmq.Socket[bytes], timeout: float = STEP) -> fp.FrontendReply:
    assert sock.poll(int(timeout * 1000)), "no reply from the coordinator"
    return fp.decode_reply(sock.recv())


def state(ctx: Ctx, address: str) -> fp.GroupState:
    sock = dealer(ctx, address)
    try:
        sock.send(fp.encode(fp.QueryState(99)))
        answer = reply(sock)
        assert isinstance(answer, fp.StateReply)
        return answer.state
    finally:
        sock.close(0)


def wait_for_counter(ctx: Ctx, address: str, name: str, at_least: int = 1) -> dict[str, int]:
    deadline = time.monotonic() + STEP
    while True:
        counters = state(ctx, address).counters
        if counters.get(name, 0) >= at_least or time.monotonic() > deadline:
            assert counters.get(name, 0) >= at_least, counters
            return counters
        time.sleep(0.05)


def test_a_submit_of_many_small_frames_past_the_bound_is_refused_and_not_kept(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx,
) -> None:
    handle = coordinator(1, extra_args=["--max-request-bytes", str(MIB)])
    frontend = dealer(zmq_ctx, handle.addresses["frontend"])
    # A control: a submit under the bound is read and answered (no engine yet).
    frontend.send_multipart([fp.encode(fp.Submit(1, "small", 0)), b"x" * 1000])
    small = reply(frontend)
    assert isinstance(small, fp.ErrorReply) and small.code == fp.ERR_NO_READY_ENGINE
    time.sleep(0.5)  # the housekeeping gives start-up memory back first
    before = rss_kb(handle.pid)

    # 48 frames of 1 MiB less a little: every frame passes libzmq's per-frame bound.
    chunk = b"\xab" * (MIB - 4096)
    frontend.send_multipart([fp.encode(fp.Submit(7, "huge", 0)), *([chunk] * 48)])
    refused = reply(frontend)
    assert isinstance(refused, fp.ErrorReply)
    assert (refused.call_id, refused.code) == (7, fp.ERR_TOO_LARGE)
    # The identity frame counts too.
    assert "50 frames" in refused.message and f"bound of {MIB} bytes" in refused.message
    counters = wait_for_counter(zmq_ctx, handle.addresses["frontend"],
                                "dropped.frontend.too_large")
    assert "submit.dispatched" not in counters

    # The coordinator goes idle; the message must not stay referenced meanwhile.
    deadline = time.monotonic() + STEP
    while (grown := rss_kb(handle.pid) - before) > 16 * 1024 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert grown <= 16 * 1024, f"RSS still {grown} kB above its level before the message"

    # The connection still works: the next call is answered.
    frontend.send_multipart([fp.encode(fp.QueryState(8))])
    assert isinstance(reply(frontend), fp.StateReply)
    frontend.close(0)


def test_engine_sockets_drop_and_count_messages_past_their_bound(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx,
) -> None:
    bound = 64 * 1024
    handle = coordinator(2, extra_args=["--max-engine-message-bytes", str(bound)])
    chunk = b"\x00" * (bound // 2)

    # handshake: a HELLO padded with frames gets the engine's error reply.
    engine = dealer(zmq_ctx, handle.addresses["handshake"], identity=(0).to_bytes(2, "little"))
    hello = msgspec.msgpack.encode({"status": "HELLO", "local": False, "headless": True})
    engine.send_multipart([hello, chunk, chunk, chunk])
    assert engine.poll(int(STEP * 1000)), "no handshake reply"
    answer = vllm.decode_handshake_reply(engine.recv())
    assert isinstance(answer, vllm.HandshakeError) and "bound of 65536 bytes" in answer.reason

    # back_output: a report followed by padding frames.
    push = zmq_ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(handle.addresses["back_output"])
    report = vllm.encode_engine_outputs(vllm.EngineCoreOutputs(engine_index=0))
    push.send_multipart([report, chunk, chunk, chunk])
    # dispatch: a greeting with padding.
    greeter = dealer(zmq_ctx, handle.addresses["dispatch"], identity=(1).to_bytes(2, "little"))
    greeter.send_multipart([b"", chunk, chunk, chunk])

    counters = wait_for_counter(zmq_ctx, handle.addresses["frontend"],
                                "dropped.back_output.too_large")
    counters = wait_for_counter(zmq_ctx, handle.addresses["frontend"],
                                "dropped.dispatch.too_large")
    assert counters.get("refused.handshake.too_large") == 1
    assert "dispatch.greetings" not in counters
    # Nothing changed: no rank was registered by any of it.
    assert [e.state for e in state(zmq_ctx, handle.addresses["frontend"]).engines] == [
        "absent", "absent"]
    for sock in (engine, push, greeter):
        sock.close(0)


async def test_the_reader_keeps_only_frames_read_before_the_bound_and_reads_on(
    zmq_ctx: Ctx,
) -> None:
    address = f"ipc://{tempfile.mkdtemp(prefix='dpc-mb-')}/frontend"
    router = zmq_ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(address)
    client = dealer(zmq_ctx, address, identity=b"fe-1")
    handled: list[list[bytes]] = []
    oversize: list[tuple[list[bytes], int, int]] = []
    reader = FrameReader(router, handled.append, name="frontend",
                         on_error=lambda name, exc: None, max_message_bytes=10_000,
                         on_oversize=lambda kept, total, count: oversize.append(
                             (kept, total, count)))
    task = asyncio.ensure_future(reader.run())
    try:
        client.send_multipart([b"header", b"a" * 4000, b"b" * 4000])  # 8,010 bytes: fits
        client.send_multipart([b"header", b"a" * 6000, b"b" * 6000, b"c" * 6000])
        client.send_multipart([b"after"])
        deadline = time.monotonic() + STEP
        while len(handled) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert [frames[1:2] for frames in handled] == [[b"header"], [b"after"]]
        assert len(handled[0]) == 4
        # Identity, header and the first payload frame were read before the bound passed.
        ((kept, total, count),) = oversize
        assert kept == [b"fe-1", b"header", b"a" * 6000]
        assert (total, count) == (4 + 6 + 18_000, 5)
        assert reader.oversize_dropped == 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        client.close(0)
        router.close(0)
