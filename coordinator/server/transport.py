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
from coordinator.server.tempdirs import make_own_dir

MIB = 1024 * 1024
# Bounds on one message, all its frames together (identity frames included), per
# socket. A message past its socket's bound is dropped and counted; libzmq's own
# per-frame bound (MAXMSGSIZE) is set to the same figure, so a single frame that
# large costs its sender the connection before it is even buffered.
DEFAULT_MAX_REQUEST_BYTES = 16 * MIB
"""``frontend``: every message, a submit with its payload frames included."""
DEFAULT_MAX_ENGINE_MESSAGE_BYTES = 1 * MIB
"""``handshake``, ``dispatch``, ``back_output``: HELLO/READY, greetings, stats reports."""
CONTROL_MAX_MESSAGE_BYTES = 64 * 1024
"""The operators' ``admin`` socket."""
PUBLISH_UPSTREAM_MAX_MESSAGE_BYTES = 512
"""Upstream of ``back_publish`` and ``front_publish``: subscriptions, SCALE_ELASTIC_EP and
legacy wakes are a few bytes, a CURVE handshake (INITIATE with its metadata) about 300.
A topic is filed by libzmq at about 44 bytes of memory a byte (server.subscriptions)."""
PUBLISH_UPSTREAM_RCVHWM = 16
"""Messages of one publish-socket connection libzmq takes in before the coordinator has
read them: a peer sends one subscription (rarely a wake or a scale request) and the rest
waits on its own side (1 starved CURVE peers' subscriptions: a handshake needs room),
which paces a flooding peer to the coordinator (server.subscriptions)."""
KV_EVENTS_MAX_MESSAGE_BYTES = 16 * MIB
"""A batch from an engine's KV event publisher, live or replayed."""

FrameHandler = Callable[[list[bytes]], None]
OversizeHandler = Callable[[list[bytes], int, int], None]
"""Called with the frames kept (those read before the bound was passed), the bytes and
the frames the whole message had."""


def make_endpoint(key: str, *, host: str | None, ipc_dir: str, port: int = 0) -> str:
    """Where to bind socket `key`: ipc in `ipc_dir` by default, tcp `port` with a host."""
    if host is None:
        return f"ipc://{os.path.join(ipc_dir, key)}"
    return tcp_endpoint(host, port)


def new_ipc_dir() -> str:
    return make_own_dir("ipc")


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

    With `source`, each message's connection is given first: `source` gets the
    file descriptor its last frame came on (`zmq.SRCFD`; a ROUTER makes the identity
    frame itself, so only the frames after it carry their connection).

    ``on_peer``, when given, hears each message's ``User-Id`` (its connection's CURVE
    key, set by the ZAP handler) just before the message is handled.

    With ``max_message_bytes``, a message whose frames together pass the bound is
    not delivered: the frames read before it passed are handed to ``on_oversize``
    (a ROUTER's identity and a header, to answer with), the rest are taken off the
    socket and released uncopied, and nothing of it stays referenced afterwards.

    ``on_address``, when given, hears each message's ``Peer-Address`` (for tcp, the
    peer's IP; None where ZeroMQ has none) just before the message is handled.
    """

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        handler: FrameHandler,
        *,
        name: str,
        on_error: Callable[[str, BaseException], None],
        batch: int = 128,
        source: Callable[[int], None] | None = None,
        max_message_bytes: int | None = None,
        on_oversize: OversizeHandler | None = None,
        on_peer: Callable[[str | None], None] | None = None,
        on_address: Callable[[str | None], None] | None = None,
    ) -> None:
        self._sock = sock
        self._handler = handler
        self._name = name
        self._on_error = on_error
        self._batch = batch
        self._source = source
        self._max_message_bytes = max_message_bytes
        self._on_oversize = on_oversize
        self._on_peer = on_peer
        self._on_address = on_address
        self._last_fd = -1
        self._readable = asyncio.Event()
        self._fd = int(sock.getsockopt(zmq.FD))
        self._loop: asyncio.AbstractEventLoop | None = None
        self.oversize_dropped = 0

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
        # Messages are read and handled in `_read_batch`, so that no frame of the last
        # message stays referenced from here while the reader waits.
        sock = self._sock
        while True:
            if self._read_batch() == self._batch:
                await asyncio.sleep(0)
                continue
            self._readable.clear()
            if int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                continue
            await self._readable.wait()

    def _read_batch(self) -> int:
        """Read and handle up to a batch of messages; returns how many were read."""
        recv = self._sock.recv
        handler, source = self._handler, self._source
        limit = self._max_message_bytes
        count = 0
        while count < self._batch:
            try:
                # copy=False gives the "more" flag with the frame, saving a
                # getsockopt(RCVMORE) per frame (the hot path's largest cost).
                frame = recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            count += 1
            if self._on_peer is not None:
                self._on_peer(peer_user_id(frame))
            if self._on_address is not None:
                self._on_address(_peer_address(frame))
            if frame.more or (limit is not None and len(frame) > limit):
                frames = self._read_multipart(frame, limit)
                if frames is None:
                    continue
                fd = self._last_fd
            else:
                frames = [frame.bytes]
                fd = source_fd(frame) if source is not None else -1
            try:
                if source is not None:
                    source(fd)
                handler(frames)
            except Exception as exc:  # a bug must not stop the socket
                self._on_error(self._name, exc)
        return count

    def _read_multipart(self, first: zmq.Frame, limit: int | None) -> list[bytes] | None:
        """The rest of a message (a multipart message arrives whole), or None when it
        passed ``limit``: from then on its frames are taken off the socket and released
        without being copied, and ``on_oversize`` hears of it."""
        recv = self._sock.recv
        frame = first
        total = len(frame)
        seen = 1
        over = limit is not None and total > limit
        frames: list[bytes] = [] if over else [frame.bytes]
        while frame.more:
            frame = recv(copy=False)
            seen += 1
            total += len(frame)
            if over:
                continue
            if limit is not None and total > limit:
                over = True
                continue
            frames.append(frame.bytes)
        if self._source is not None:
            self._last_fd = source_fd(frame)
        del frame, first
        if not over:
            return frames
        self.oversize_dropped += 1
        if self._on_oversize is not None:
            try:
                self._on_oversize(frames, total, seen)
            except Exception as exc:
                self._on_error(self._name, exc)
        return None


def source_fd(frame: zmq.Frame) -> int:
    """The descriptor of the connection ``frame`` came on, or -1: an XPUB's own
    cancellations (of a closed connection's topics) came on none."""
    try:
        return int(frame.get(zmq.SRCFD))
    except zmq.ZMQError:
        return -1


def peer_user_id(frame: zmq.Frame) -> str | None:
    """The ``User-Id`` the ZAP handler gave the frame's connection (a CURVE key), if any."""
    try:
        value = frame.get("User-Id")
    except zmq.ZMQError:
        return None
    return value if isinstance(value, str) and value else None


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

    def log(self, level: int, key: str, message: str, *args: object,
            exc_info: BaseException | None = None,
            extra: dict[str, object] | None = None) -> None:
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
        if extra is not None and suppressed:
            extra = {**extra, "suppressed": suppressed}
        self.logger.log(level, message, *args, exc_info=exc_info, extra=extra)
