"""Connection budgets: no peer can open enough connections to exhaust the descriptors.

Every connection a listening socket accepts costs the process a descriptor, and
libzmq does not survive running out of them: over ipc its I/O thread asserts
in ``accept`` (``Too many open files (src/ipc_listener.cpp)``) and the
process aborts; over tcp it retries ``accept`` in a loop and takes a whole
core until connections close. Any peer that can reach a socket can open
connections, greeting or not.

So each engine-facing socket has a budget of open connections: what the
configured group needs of it, plus an equal share of what the open-file limit
leaves after a reserve for the process itself (``fdlimit.RESERVE``: libzmq's
own descriptors, HTTP, the state file, operators' connections, and room for
connections accepted before the gate could act). The gate counts each
socket's connections from its monitor (``EVENT_ACCEPTED`` and
``EVENT_DISCONNECTED``); a connection accepted while its socket is at the
budget is shut down at once (libzmq then closes it as a lost peer) and
counted as ``refused.connections.<socket>``, and the first refusal of a
socket, and then one every log interval, is a WARNING naming the socket and
the remedy.

The listener itself stays bound: in libzmq a listener owns the connections it
accepted, so closing it to stop accepting would drop every connected engine
with it.
"""

from __future__ import annotations

import contextlib
import logging
import resource
import struct
from collections import Counter
from collections.abc import Callable, Mapping

import zmq

from coordinator.protocol.addresses import SOCKET_KEYS
from coordinator.server.connections import cut
from coordinator.server.fdlimit import MIN_FRONTENDS, RESERVE, UNLIMITED_TARGET
from coordinator.server.transport import RateLimitedLog

log = logging.getLogger("coordinator.server")

_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
_HEADER = struct.Struct("=Hi")  # event id, value (the descriptor)
FRONTEND_SOCKETS = frozenset({"frontend", "front_publish"})
"""Sockets a frontend connects to; the other four are an engine's."""


def connection_budgets(limit: int, engines: int, frontends: int) -> dict[str, int]:
    """Open connections each engine-facing socket may hold under an open-file ``limit``.

    Each socket gets what the group needs of it (an engine on each engine socket, a
    frontend on each frontend socket) and an equal share of what is left of half the
    limit. The other half (at least ``RESERVE``) is the process's own and the room for
    connections libzmq accepts faster than the gate can shut them: a local peer
    connecting in a tight loop gets a few hundred accepted before the gate has read
    their monitor events."""
    planned = {key: max(frontends, MIN_FRONTENDS) if key in FRONTEND_SOCKETS else engines
               for key in SOCKET_KEYS}
    shared = min(limit // 2, limit - RESERVE)
    spare = max(0, shared - sum(planned.values())) // len(planned)
    return {key: max(1, need + spare) for key, need in planned.items()}


def open_file_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return UNLIMITED_TARGET if soft == resource.RLIM_INFINITY else soft


class SocketGate:
    """The open connections of one socket, against its budget."""

    def __init__(self, key: str, budget: int, counters: Counter[str],
                 ratelog: RateLimitedLog) -> None:
        self.key = key
        self.budget = budget
        self.kept: set[int] = set()
        """Descriptors of the connections within the budget."""
        self._cutting: set[int] = set()
        self._counters = counters
        self._ratelog = ratelog

    def accepted(self, fd: int) -> bool:
        """A connection was accepted on ``fd``; False when it was refused (shut down)."""
        if fd in self._cutting:
            # The descriptor of a refused connection, closed and reused: the close
            # event is still on its way.
            self._cutting.discard(fd)
        if len(self.kept) < self.budget:
            self.kept.add(fd)
            return True
        self._cutting.add(fd)
        cut(fd)
        self._counters[f"refused.connections.{self.key}"] += 1
        self._ratelog.log(
            logging.WARNING, f"connection_budget:{self.key}",
            "socket %s is at its budget of %d open connections: refusing new ones (a "
            "peer opening connections it does not use, or a group larger than planned: "
            "raise the open-file limit, e.g. `ulimit -n` or LimitNOFILE, and --engines/"
            "--frontends to what connects)", self.key, self.budget)
        return False

    def refuse(self, fd: int) -> None:
        """Shut the kept connection on ``fd`` down (its peer broke the protocol)."""
        self.kept.discard(fd)
        self._cutting.add(fd)
        cut(fd)

    def disconnected(self, fd: int) -> None:
        self.kept.discard(fd)
        self._cutting.discard(fd)

    def holds(self, fd: int) -> bool:
        return fd in self.kept


class _GateMonitor:
    """A socket's monitor read for the gate alone (sockets without ``PeerConnections``)."""

    def __init__(self, sock: zmq.Socket[bytes], gate: SocketGate) -> None:
        self.monitor: zmq.Socket[bytes] = sock.get_monitor_socket(_EVENTS)
        self._sock = sock
        self._gate = gate

    def on_monitor_message(self, frames: list[bytes]) -> None:
        if len(frames) != 2 or len(frames[0]) != _HEADER.size:
            return
        event, fd = _HEADER.unpack(frames[0])
        if event == zmq.EVENT_ACCEPTED:
            self._gate.accepted(fd)
        elif event == zmq.EVENT_DISCONNECTED:
            self._gate.disconnected(fd)

    def read(self) -> None:
        """Apply every monitor event queued so far."""
        while True:
            try:
                frames = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.on_monitor_message(frames)

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self.monitor.close(linger=0)


class ConnectionGate:
    """The budgets of all engine-facing sockets; see the module docstring."""

    def __init__(self, engines: int, frontends: int, log_interval_s: float,
                 clock: Callable[[], float]) -> None:
        self._engines = engines
        self._frontends = frontends
        self._budgets: dict[str, int] | None = None
        self.sockets: dict[str, SocketGate] = {}
        self._monitors: dict[str, _GateMonitor] = {}
        self._counters: Counter[str] = Counter()
        self._ratelog = RateLimitedLog(log, interval_s=log_interval_s, clock=clock)

    def attach(self, key: str, sock: zmq.Socket[bytes], *, monitored: bool) -> SocketGate:
        """Gate socket ``key`` (before it binds). ``monitored``: its monitor is read
        elsewhere, which passes the events on (``PeerConnections``); else the gate
        monitors it itself."""
        if self._budgets is None:
            # Read when the first socket is made: the limit was settled by then.
            limit = open_file_limit()
            self._budgets = connection_budgets(limit, self._engines, self._frontends)
            log.info("connection budgets under an open-file limit of %d: %s", limit,
                     ", ".join(f"{k} {v}" for k, v in self._budgets.items()))
        gate = SocketGate(key, self._budgets[key], self._counters, self._ratelog)
        self.sockets[key] = gate
        if not monitored:
            self._monitors[key] = _GateMonitor(sock, gate)
        return gate

    def monitors(self) -> Mapping[str, tuple[zmq.Socket[bytes], Callable[[list[bytes]], None]]]:
        """The monitor sockets the gate reads itself, by socket, with their handlers."""
        return {key: (m.monitor, m.on_monitor_message) for key, m in self._monitors.items()}

    def read_monitor(self, key: str) -> None:
        monitor = self._monitors.get(key)
        if monitor is not None:
            monitor.read()

    def counters(self) -> dict[str, int]:
        return dict(self._counters)

    def close(self) -> None:
        for monitor in self._monitors.values():
            monitor.close()
        self._monitors.clear()
