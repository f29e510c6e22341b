"""The server's multipart sends (coordinator/server/sending.py) on real sockets.

They replace pyzmq's ``send_multipart`` on every hot path, so they must put the
same frames on the wire, leave a message whole or not at all, and fail the
way the server expects: ``zmq.Again`` when the peer's queue is full and
EHOSTUNREACH for an identity nobody holds (``ROUTER_MANDATORY``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import zmq

from coordinator.server.sending import poke_if_readable, send_add, send_frames, send_routed
from coordinator.server.transport import FrameReader

Ctx = zmq.Context[zmq.Socket[bytes]]


def pair(ctx: Ctx, tmp: str, kind: int, peer_kind: int, *,
         identity: bytes | None = None) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
    server = ctx.socket(kind)
    server.setsockopt(zmq.LINGER, 0)
    if kind == zmq.ROUTER:
        server.setsockopt(zmq.ROUTER_MANDATORY, 1)
    server.bind(f"ipc://{tmp}/s")
    peer = ctx.socket(peer_kind)
    peer.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        peer.setsockopt(zmq.IDENTITY, identity)
    peer.connect(f"ipc://{tmp}/s")
    return server, peer


def test_each_send_puts_exactly_its_frames_on_the_wire(zmq_ctx: Ctx, tmp_path: Path) -> None:
    router, dealer = pair(zmq_ctx, str(tmp_path), zmq.ROUTER, zmq.DEALER, identity=b"\x05\x00")
    dealer.send(b"hello")
    assert router.recv_multipart() == [b"\x05\x00", b"hello"]
    payload = zmq.Frame(b"p" * 3000)
    send_add(router, b"\x05\x00", b"\x00", [b"header", payload])
    send_add(router, b"\x05\x00", b"\x01", [])
    send_routed(router, b"\x05\x00", [b"one"])
    send_routed(router, b"\x05\x00", [b"a", b"b", b"c"])
    assert dealer.poll(5000)
    assert dealer.recv_multipart() == [b"\x00", b"header", b"p" * 3000]
    assert dealer.recv_multipart() == [b"\x01"]
    assert dealer.recv_multipart() == [b"one"]
    assert dealer.recv_multipart() == [b"a", b"b", b"c"]


def test_publishes_go_out_whole(zmq_ctx: Ctx, tmp_path: Path) -> None:
    xpub, xsub = pair(zmq_ctx, str(tmp_path), zmq.XPUB, zmq.XSUB)
    xsub.send(b"\x01")
    assert xpub.poll(5000) and xpub.recv() == b"\x01"
    send_frames(xpub, [b"\x02", b"wave"])
    send_frames(xpub, [b"READY"])
    assert xsub.poll(5000)
    assert xsub.recv_multipart() == [b"\x02", b"wave"]
    assert xsub.recv_multipart() == [b"READY"]


def test_an_identity_nobody_holds_fails_and_sends_nothing(zmq_ctx: Ctx, tmp_path: Path) -> None:
    router, dealer = pair(zmq_ctx, str(tmp_path), zmq.ROUTER, zmq.DEALER, identity=b"\x01\x00")
    dealer.send(b"hello")
    router.recv_multipart()
    with pytest.raises(zmq.ZMQError) as caught:
        send_add(router, b"\x07\x00", b"\x00", [b"x"])
    assert caught.value.errno == zmq.EHOSTUNREACH
    with pytest.raises(zmq.ZMQError):
        send_routed(router, b"\x07\x00", [b"x"])
    # The socket is not left inside a half-sent message: the next one arrives whole.
    send_routed(router, b"\x01\x00", [b"after"])
    assert dealer.poll(5000) and dealer.recv_multipart() == [b"after"]


def test_a_full_queue_raises_again_and_the_message_is_not_split(zmq_ctx: Ctx,
                                                                 tmp_path: Path) -> None:
    router, dealer = pair(zmq_ctx, str(tmp_path), zmq.ROUTER, zmq.DEALER, identity=b"\x02\x00")
    router.setsockopt(zmq.SNDHWM, 2)
    dealer.setsockopt(zmq.RCVHWM, 2)
    dealer.send(b"hello")
    router.recv_multipart()
    sent = 0
    with pytest.raises(zmq.Again):
        for _ in range(100_000):
            send_add(router, b"\x02\x00", b"\x00", [b"h", b"payload"])
            sent += 1
    got = 0
    while dealer.poll(200):
        assert dealer.recv_multipart() == [b"\x00", b"h", b"payload"]
        got += 1
    assert got == sent


async def test_a_reader_is_poked_after_a_send_only_when_a_message_waits(tmp_path: Path) -> None:
    """The cure for a send swallowing a read edge, without a wake-up per send.

    As in the chaos run's deaf frontend socket: a request arrives while the loop is
    busy, then a send on the same socket lets libzmq clear the FD. The reader must
    still get the request; and a send with nothing waiting must not wake it.
    """
    ctx: Ctx = zmq.Context()
    router, client = pair(ctx, str(tmp_path), zmq.ROUTER, zmq.DEALER, identity=b"frontend-0")
    handled: list[bytes] = []
    pokes: list[int] = []
    reader = FrameReader(router, lambda frames: handled.append(frames[1]), name="frontend",
                         on_error=lambda name, exc: None)

    def poke() -> None:
        pokes.append(1)
        reader.poke()

    task = asyncio.ensure_future(reader.run())
    try:
        client.send(b"first")
        await wait_for(lambda: handled == [b"first"])
        send_routed(router, b"frontend-0", [b"reply"])
        poke_if_readable(router, poke)
        assert pokes == []  # nothing was waiting: no wake-up
        client.send(b"second")
        time.sleep(0.1)  # the loop is busy while libzmq signals the FD
        send_routed(router, b"frontend-0", [b"a notice"])
        poke_if_readable(router, poke)
        assert pokes == [1]
        await wait_for(lambda: handled == [b"first", b"second"])
        client.send(b"third")
        await wait_for(lambda: handled == [b"first", b"second", b"third"])
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        router.close(0)
        client.close(0)
        ctx.term()


async def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)
