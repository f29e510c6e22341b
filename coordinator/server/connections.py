"""Connection facts for ``handshake`` and ``dispatch``: which connection a message came on.

libzmq does not say which connection a ROUTER message came on, but it does say
two things this module puts together:

* every received frame carries the file descriptor of its connection
  (``zmq.SRCFD``);
* the socket's monitor reports ``EVENT_ACCEPTED`` and ``EVENT_DISCONNECTED``
  with that same descriptor.

``PeerConnections`` numbers each accepted connection (the ``conn`` of the
core's events, never 0 and never reused, unlike descriptors), looks up the
connection of each message by its descriptor, and turns the monitor's events
into ``PeerConnected`` and ``PeerDisconnected``. Order matters and is kept:

* a message is looked up only after every monitor event already queued has
  been applied, so a descriptor reused by a new connection is never taken for
  the old one;
* a disconnect is reported only once the socket has no message left to read:
  libzmq queues a connection's last messages before it reports the
  connection closed, so the core always sees an engine's READY before the
  close of the connection it came on.

The monitor is attached before the socket binds, so no connection is missed.
No decisions here: the core decides what a connection that closed means.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
from collections.abc import Callable, Iterator

import zmq

from coordinator.core.events import ConnectionSocket, Event, PeerConnected, PeerDisconnected

_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
_HEADER = struct.Struct("=Hi")  # event id, value (the descriptor)


def describe_peer(fd: int) -> str:
    """Who is at the other end of descriptor ``fd``: ``host:port``, ``pid N`` or ``""``."""
    try:
        peer = socket.socket(fileno=os.dup(fd))
    except OSError:
        return ""
    with peer:
        try:
            if peer.family == socket.AF_UNIX:
                creds = peer.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                        struct.calcsize("3i"))
                return f"pid {struct.unpack('3i', creds)[0]}"
            host, port = peer.getpeername()[:2]
            return f"{host}:{port}"
        except OSError:
            return ""


class PeerConnections:
    """The connections of one ROUTER socket, from its monitor; see the module docstring."""

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        name: ConnectionSocket,
        ids: Iterator[int],
        feed: Callable[[Event], None],
    ) -> None:
        self.name = name
        self.monitor: zmq.Socket[bytes] = sock.get_monitor_socket(_EVENTS)
        self._sock = sock
        self._ids = ids
        self._feed = feed
        self._by_fd: dict[int, int] = {}
        self._closing: list[int] = []
        self.current = 0
        """The connection of the message being handled (0: not known)."""

    def read_monitor(self) -> None:
        """Apply every monitor event queued so far (closes are held; see ``flush_closed``)."""
        monitor = self.monitor
        while True:
            try:
                frames = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.on_monitor_message(frames)

    def on_monitor_message(self, frames: list[bytes]) -> None:
        if len(frames) != 2 or len(frames[0]) != _HEADER.size:
            return
        event, fd = _HEADER.unpack(frames[0])
        if event == zmq.EVENT_ACCEPTED:
            conn = next(self._ids)
            self._by_fd[fd] = conn
            self._feed(PeerConnected(self.name, conn, describe_peer(fd)))
        elif event == zmq.EVENT_DISCONNECTED:
            self._closing.append(fd)

    def source(self, fd: int) -> None:
        """The next message came on descriptor ``fd``: make its connection ``current``."""
        self.read_monitor()
        self.current = self._by_fd.get(fd, 0)

    def flush_closed(self) -> None:
        """The socket had nothing left to read: report the connections whose close was
        seen before that (their last messages were read)."""
        while self._closing:
            conn = self._by_fd.pop(self._closing.pop(0), None)
            if conn is not None:
                self._feed(PeerDisconnected(self.name, conn))

    @property
    def open_connections(self) -> int:
        return len(self._by_fd)

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self.monitor.close(linger=0)
