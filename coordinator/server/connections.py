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
into ``PeerConnected`` and ``PeerDisconnected``. Two orders matter:

* a message is looked up only after every monitor event already queued has
  been applied, so a descriptor reused by a new connection is never taken for
  the old one;
* libzmq reports a connection closed while messages it received before may
  still wait in the socket (behind other connections' messages). Such a
  message is delivered with its connection all the same, and the close is
  reported again right after it (``closed_after``), so the core never keeps
  a fact (a HELLO, a greeting) about a connection that is gone.

Two more facts come from a connection's descriptor when the core asks:
``heard_ago`` (how long ago anything, a heartbeat answer included, arrived on a
tcp connection: the kernel's ``tcpi_last_data_recv``) and ``cut`` (shut a
connection down, so that libzmq closes it and frees the identity it holds,
for a crashed host's connection that nothing else would ever close).

The monitor is attached before the socket binds, so no connection is missed.
No decisions here: the core decides what a connection that closed means.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
from collections.abc import Callable, Iterator
from typing import Protocol

import zmq

from coordinator.core.actions import ConnectionSocket
from coordinator.core.events import Event, PeerConnected, PeerDisconnected


class ConnectionWatcher(Protocol):
    """Hears every connection accepted and closed (server.connection_gate's budgets)."""

    def accepted(self, fd: int) -> bool:
        """False: the connection was refused (and is being shut down)."""
        ...

    def disconnected(self, fd: int) -> None: ...

_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
_HEADER = struct.Struct("=Hi")  # event id, value (the descriptor)
# struct tcp_info: __u32 tcpi_last_data_recv (milliseconds) at byte 52 (Linux).
_TCP_INFO_BYTES = 104
_LAST_DATA_RECV = struct.Struct("=I")
_LAST_DATA_RECV_OFFSET = 52
_IP_FAMILIES = (socket.AF_INET, socket.AF_INET6)


def heard_ago(fd: int) -> float | None:
    """Seconds since data last arrived on tcp descriptor ``fd``; None if it cannot tell."""
    option = getattr(socket, "TCP_INFO", None)
    if option is None:
        return None
    try:
        peer = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    with peer:
        if peer.family not in _IP_FAMILIES:
            return None
        try:
            info = peer.getsockopt(socket.IPPROTO_TCP, option, _TCP_INFO_BYTES)
        except OSError:
            return None
    if len(info) < _LAST_DATA_RECV_OFFSET + _LAST_DATA_RECV.size:
        return None
    return float(_LAST_DATA_RECV.unpack_from(info, _LAST_DATA_RECV_OFFSET)[0]) / 1000.0


def cut(fd: int) -> None:
    """Shut down descriptor ``fd`` both ways; libzmq then closes it as a lost peer."""
    with contextlib.suppress(OSError):
        peer = socket.socket(fileno=os.dup(fd))
        with peer:
            peer.shutdown(socket.SHUT_RDWR)


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
        gate: ConnectionWatcher | None = None,
    ) -> None:
        self.name = name
        self._gate = gate
        self.monitor: zmq.Socket[bytes] = sock.get_monitor_socket(_EVENTS)
        self._sock = sock
        self._ids = ids
        self._feed = feed
        # Descriptor -> connection; a closed one stays (negated) until its number is
        # reused, so that its late messages still name it. One entry per descriptor.
        self._by_fd: dict[int, int] = {}
        self._open: dict[int, int] = {}  # conn -> descriptor, open connections only
        self.current = 0
        """The connection of the message being handled (0: not known)."""
        self.closed_after = 0
        """That connection, when it is already closed (report the close again after it)."""

    def read_monitor(self) -> None:
        """Apply every monitor event queued so far."""
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
            if self._gate is not None and not self._gate.accepted(fd):
                self._by_fd.pop(fd, None)  # refused: its messages name no connection
                return
            conn = next(self._ids)
            self._by_fd[fd] = conn
            self._open[conn] = fd
            self._feed(PeerConnected(self.name, conn, describe_peer(fd)))
        elif event == zmq.EVENT_DISCONNECTED:
            if self._gate is not None:
                self._gate.disconnected(fd)
            conn = self._by_fd.get(fd, 0)
            if conn > 0:
                self._by_fd[fd] = -conn
                del self._open[conn]
                self._feed(PeerDisconnected(self.name, conn))

    def source(self, fd: int) -> None:
        """The next message came on descriptor ``fd``: make its connection ``current``."""
        self.read_monitor()
        conn = self._by_fd.get(fd, 0)
        self.current = abs(conn)
        self.closed_after = -conn if conn < 0 else 0

    def message_done(self) -> None:
        """The current message was handled: repeat its connection's close if it had one."""
        if self.closed_after:
            conn, self.closed_after = self.closed_after, 0
            self._feed(PeerDisconnected(self.name, conn))

    def heard_ago(self, conn: int) -> float | None:
        """How long ago data last arrived on open connection ``conn`` (tcp only)."""
        self.read_monitor()
        fd = self._open.get(conn)
        return None if fd is None else heard_ago(fd)

    def cut(self, conn: int) -> bool:
        """Shut open connection ``conn`` down; False if it is not open (any more)."""
        self.read_monitor()  # its descriptor may have been closed and reused meanwhile
        fd = self._open.get(conn)
        if fd is None:
            return False
        cut(fd)
        return True

    @property
    def open_connections(self) -> int:
        return len(self._open)

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self.monitor.close(linger=0)
