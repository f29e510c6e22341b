"""ZMQ plumbing for the server: endpoints, socket options, batched reads, logs.

The server uses plain (synchronous) pyzmq sockets driven from the asyncio loop:
reads wait on the socket's FD and then drain up to a batch with NOBLOCK, sends are
always NOBLOCK. That avoids a future per message (the coordinator may ingest
100k stats messages a second) and means no send can ever stall the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import zmq

from coordinator.protocol.addresses import is_ipv6_tcp, tcp_endpoint

# Bounds on what any peer may send us; larger messages drop the connection.
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024

FrameHandler = Callable[[list[bytes]], None]
PeerFrameHandler = Callable[[list[bytes], str | None], None]
"""A handler that also gets the sending peer's address (``FrameReader(peer=True)``)."""


def make_endpoint(key: str, *, host: str | None, ipc_dir: str, port: int = 0) -> str:
    """Where to bind socket `key`: ipc in `ipc_dir` by default, tcp `port` with a host."""
    if host is None:
        return f"ipc://{os.path.join(ipc_dir, key)}"
    return tcp_endpoint(host, port)


def new_ipc_dir() -> str:
    return tempfile.mkdtemp(prefix="dp-coordinator-")


def bind_socket(
    ctx: zmq.Context[zmq.Socket[bytes]],
    kind: int,
    endpoint: str,
    *,
    max_message_bytes: int,
    options: Iterable[tuple[int, int]] = (),
    configure: Callable[[zmq.Socket[bytes]], None] | None = None,
) -> tuple[zmq.Socket[bytes], str]:
    """Create, configure and bind a socket; return it with its resolved endpoint."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    if is_ipv6_tcp(endpoint):
        sock.setsockopt(zmq.IPV6, 1)
    for option, value in options:
        sock.setsockopt(option, value)
    if configure is not None:
        configure(sock)
    try:
        sock.bind(endpoint)
    except zmq.ZMQError:
        sock.close(0)
        raise
    raw = sock.getsockopt(zmq.LAST_ENDPOINT)
    resolved = raw.decode() if isinstance(raw, bytes) else str(raw)
    return sock, resolved


def write_address_file(path: str, addresses: dict[str, str]) -> None:
    """Write the address file atomically so readers never see half of it."""
    directory = os.path.dirname(os.path.abspath(path)) or "."
    fd, tmp = tempfile.mkstemp(prefix=".addr-", dir=directory)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(addresses, handle, indent=2, sort_keys=True)
            handle.write("\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class FrameReader:
    """Delivers every multipart message of one socket to a handler, in batches.

    The ZMQ FD only signals "something may have changed"; after it fires we drain
    with NOBLOCK until EAGAIN or a full batch, then yield to the loop so that one
    busy socket cannot starve the others or the publish timer.

    The FD is edge-triggered and every operation on the socket consumes edges, a
    send included: a send from another task while this reader sleeps can swallow
    the edge of a message that arrived meanwhile, and the reader would never wake.
    Whoever sends on a read socket must therefore call `poke()` afterwards.

    With `peer=True` the handler is a `PeerFrameHandler`: it also gets the
    address of the peer the message came from (ZeroMQ's ``Peer-Address``;
    for tcp, its IP), or None where ZeroMQ has none.
    """

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        handler: FrameHandler | PeerFrameHandler,
        *,
        name: str,
        on_error: Callable[[str, BaseException], None],
        batch: int = 128,
        peer: bool = False,
    ) -> None:
        self._sock = sock
        self._handler = handler
        self._peer = peer
        self._name = name
        self._on_error = on_error
        self._batch = batch
        self._readable = asyncio.Event()
        self._fd = int(sock.getsockopt(zmq.FD))
        self._loop: asyncio.AbstractEventLoop | None = None

    def poke(self) -> None:
        """Make the reader look at the socket again (after a send on it elsewhere)."""
        self._readable.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self._loop = loop
        loop.add_reader(self._fd, self._readable.set)
        try:
            await self._pump()
        finally:
            with contextlib.suppress(Exception):
                loop.remove_reader(self._fd)

    async def _pump(self) -> None:
        sock = self._sock
        recv = sock.recv
        handler = self._handler
        while True:
            count = 0
            while count < self._batch:
                try:
                    # copy=False gives the "more" flag with the frame, saving a
                    # getsockopt(RCVMORE) per frame (the hot path's largest cost).
                    frame = recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                frames = [frame.bytes]
                address = _peer_address(frame) if self._peer else None
                while frame.more:  # a multipart message arrives whole
                    frame = recv(copy=False)
                    frames.append(frame.bytes)
                count += 1
                try:
                    if self._peer:
                        handler(frames, address)  # type: ignore[call-arg]
                    else:
                        handler(frames)  # type: ignore[call-arg]
                except Exception as exc:  # a bug must not stop the socket
                    self._on_error(self._name, exc)
            if count == self._batch:
                await asyncio.sleep(0)
                continue
            self._readable.clear()
            if int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                continue
            await self._readable.wait()


def _peer_address(frame: zmq.Frame) -> str | None:
    try:
        address = frame.get("Peer-Address")
    except zmq.ZMQError:
        return None
    return address if isinstance(address, str) and address else None


@dataclass
class RateLimitedLog:
    """At most one log line per key per interval; says how many were suppressed."""

    logger: logging.Logger
    interval_s: float = 5.0
    clock: Callable[[], float] = time.monotonic
    _last: dict[str, float] = field(default_factory=dict)
    _suppressed: dict[str, int] = field(default_factory=dict)
    max_keys: int = 4096

    def log(self, level: int, key: str, message: str, *args: object) -> None:
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return
        if len(self._last) >= self.max_keys and key not in self._last:
            # Bound memory under an attacker that varies the key: forget old keys.
            self._last.clear()
            self._suppressed.clear()
        suppressed = self._suppressed.pop(key, 0)
        self._last[key] = now
        if suppressed:
            message += " (%d similar messages suppressed)"
            args = (*args, suppressed)
        self.logger.log(level, message, *args)
