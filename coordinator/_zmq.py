"""Process and socket plumbing shared by everything that talks to a coordinator.

The SDKs, the simulated engines and the command-line tools all open ZeroMQ
sockets, load CURVE keys, run an event loop, start child processes and wait for
a coordinator's address file. Each of those is done here, once.

Sockets by role
---------------
A socket's high-water marks and linger follow from what it is for; `connect`
and `bind` take the role and set nothing else by hand:

* `ENGINE`: an engine's sockets, set as vLLM's `make_zmq_socket` sets them.
  Point-to-point sockets (PUSH, PULL, DEALER, ROUTER) have no high-water mark,
  so a send never blocks or drops (vLLM's engine loop relies on that) and the
  peer's reading speed is the only bound; the XSUB keeps libzmq's default.
  Linger is chosen per socket by the caller.
* `CLIENT`: a frontend's or an operator tool's DEALER to the coordinator's
  `frontend` socket, and its XSUB on `front_publish`. libzmq's default bound of
  1000 messages each way, so a coordinator that is gone turns a NOBLOCK send
  into `zmq.Again` instead of unbounded memory. Linger 0: once the client
  closes, nothing it queued is worth waiting for.
* `OUTPUTS`: the PULL a frontend binds for engine outputs. No high-water mark:
  an engine pushes every output unbounded, and a dropped one is a lost request.
  Linger 0.
* `COLLECTIVE`: the simulated engines' collective hub and its clients. No
  high-water mark, since a dropped contribution would look like a hang.
  Linger 0.

Every role sets `IPV6` on a socket whose endpoint has a bracketed IPv6 host,
which libzmq otherwise refuses.

CURVE on the client side
------------------------
The coordinator encrypts and authenticates its TCP sockets when it has keys
(`coordinator.server.curve`). A client gives `CurveClientKeys` (its own secret
key file and the coordinator's public key file); they are applied to sockets
that connect over TCP only, because the coordinator leaves ipc plain and a CURVE
client on a plain socket fails its handshake silently. Key files are the ZeroMQ
certificate format (`NAME.key` public, `NAME.key_secret` secret), made by
`dp-coordinator keygen`.

Why a connection gets no answer
-------------------------------
A refused ZeroMQ peer is never told in band: its messages queue and nothing
comes back. libzmq does tell the client's socket monitor how each ZMTP
handshake ended, and `HandshakeMonitor` turns that into a sentence
(`describe_handshake_failure`): the coordinator refused our CURVE key (the ZAP
handler's status 400), it requires CURVE keys we did not give, it has no keys
while we use some (both a mechanism mismatch), or it closed the connection in
the middle of the handshake (a server key file that is not this coordinator's
public key; or a mechanism mismatch the server noticed before we read its
greeting). After a refused key or a mechanism mismatch libzmq does not
reconnect, so no later answer can come (`HandshakeFailure.final`); a dropped
handshake is retried, and the retry that sees a mismatch names it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import json
import signal
import socket
import struct
import sys
import time
import uuid
from collections.abc import Callable, Collection, Coroutine
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import zmq
import zmq.auth

from coordinator.protocol.addresses import is_ipv6_tcp

__all__ = [
    "CLIENT",
    "COLLECTIVE",
    "ENGINE",
    "LOOP_CHOICES",
    "OUTPUTS",
    "PARENT_DEATH_SIGNAL",
    "AddressFileTimeout",
    "CurveClientKeys",
    "HandshakeFailure",
    "HandshakeMonitor",
    "SocketRole",
    "bind",
    "configure_client_socket",
    "connect",
    "connect_monitored",
    "describe_handshake_failure",
    "die_with_parent_preexec",
    "endpoint_accepts_connections",
    "load_public_key",
    "load_secret_key",
    "read_address_file",
    "run_loop",
    "wait_for_address_file",
]

_S = TypeVar("_S", bound="zmq.Socket[Any]")
_T = TypeVar("_T")

# ---- sockets ---------------------------------------------------------------------------------

# Socket types that queue in each direction between two fixed peers. Publish and
# subscribe sockets are left at libzmq's default, as vLLM leaves them.
_RECEIVING_TYPES: Final = frozenset({zmq.PULL, zmq.DEALER, zmq.ROUTER})
_SENDING_TYPES: Final = frozenset({zmq.PUSH, zmq.DEALER, zmq.ROUTER})


@dataclass(frozen=True)
class SocketRole:
    """How one kind of socket is set up (see the module docstring for each role)."""

    name: str
    unbounded: bool
    """No high-water mark on the directions a point-to-point socket uses."""
    linger_ms: int | None
    """LINGER for the socket; None leaves libzmq's default or the caller's choice."""


ENGINE: Final = SocketRole("engine", unbounded=True, linger_ms=None)
CLIENT: Final = SocketRole("client", unbounded=False, linger_ms=0)
OUTPUTS: Final = SocketRole("outputs", unbounded=True, linger_ms=0)
COLLECTIVE: Final = SocketRole("collective", unbounded=True, linger_ms=0)


def _new_socket(
    ctx: zmq.Context[_S],
    socket_type: int,
    endpoint: str,
    role: SocketRole,
    identity: bytes | None,
    linger_ms: int | None,
) -> _S:
    sock = ctx.socket(socket_type)
    if role.unbounded:
        if socket_type in _RECEIVING_TYPES:
            sock.setsockopt(zmq.RCVHWM, 0)
        if socket_type in _SENDING_TYPES:
            sock.setsockopt(zmq.SNDHWM, 0)
    linger = role.linger_ms if linger_ms is None else linger_ms
    if linger is not None:
        sock.setsockopt(zmq.LINGER, linger)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if is_ipv6_tcp(endpoint):
        sock.setsockopt(zmq.IPV6, 1)
    return sock


def connect(
    ctx: zmq.Context[_S],
    socket_type: int,
    address: str,
    role: SocketRole,
    *,
    identity: bytes | None = None,
    linger_ms: int | None = None,
    curve: CurveClientKeys | None = None,
) -> _S:
    """A new socket of `role`, connected to `address` (a CURVE client there if `curve`).

    `linger_ms` overrides the role's linger for this one socket.
    """
    sock = _new_socket(ctx, socket_type, address, role, identity, linger_ms)
    try:
        if curve is not None:
            curve.apply(sock, address)
        sock.connect(address)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def connect_monitored(
    ctx: zmq.Context[_S],
    socket_type: int,
    address: str,
    role: SocketRole,
    *,
    identity: bytes | None = None,
    linger_ms: int | None = None,
    curve: CurveClientKeys | None = None,
) -> tuple[_S, HandshakeMonitor]:
    """`connect`, with a `HandshakeMonitor` attached before the connection starts.

    Close the monitor before the socket's context is terminated.
    """
    sock = _new_socket(ctx, socket_type, address, role, identity, linger_ms)
    monitor: HandshakeMonitor | None = None
    try:
        monitor = HandshakeMonitor(sock, address,
                                   curve=curve is not None and curve.applies_to(address))
        if curve is not None:
            curve.apply(sock, address)
        sock.connect(address)
    except BaseException:
        if monitor is not None:
            monitor.close()
        sock.close(linger=0)
        raise
    return sock, monitor


def bind(
    ctx: zmq.Context[_S],
    socket_type: int,
    endpoint: str,
    role: SocketRole,
    *,
    linger_ms: int | None = None,
) -> tuple[_S, str]:
    """A new socket of `role`, bound at `endpoint`; returns it and the resolved endpoint.

    The resolved endpoint names the port a `tcp://host:0` bind was given.
    """
    sock = _new_socket(ctx, socket_type, endpoint, role, None, linger_ms)
    try:
        sock.bind(endpoint)
        raw = sock.getsockopt(zmq.LAST_ENDPOINT)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock, raw.decode() if isinstance(raw, bytes) else str(raw)


# ---- CURVE client keys -----------------------------------------------------------------------

Z85_KEY_LENGTH: Final = 40  # a 32-byte Curve25519 key in Z85


def load_secret_key(path: str) -> tuple[bytes, bytes]:
    """``(public, secret)`` Z85 keys from a secret key file; ValueError if it is not one."""
    public, secret = _load_key_file(path)
    if secret is None:
        raise ValueError(
            f"{path} holds only a public key; give the secret key file "
            "(NAME.key_secret, made by `dp-coordinator keygen`)"
        )
    return public, secret


def load_public_key(path: str) -> bytes:
    """The Z85 public key of a key file (public or secret)."""
    return _load_key_file(path)[0]


def _load_key_file(path: str) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except OSError as exc:
        raise ValueError(f"cannot read key file {path}: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"{path} is not a ZeroMQ key file: {exc}") from None
    for key in (public, secret):
        if key is not None and len(key) != Z85_KEY_LENGTH:
            raise ValueError(f"{path} holds a malformed key ({len(key)} characters, "
                             f"expected {Z85_KEY_LENGTH})")
    return public, secret


def configure_client_socket(
    sock: zmq.Socket[Any], client_secret_file: str, server_public_file: str
) -> None:
    """Make ``sock`` a CURVE client of the coordinator (call before connect)."""
    public, secret = load_secret_key(client_secret_file)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SERVERKEY, load_public_key(server_public_file))


@dataclass(frozen=True)
class CurveClientKeys:
    """Key files that make a socket a CURVE client of the coordinator."""

    secret_key_file: str
    """This client's `NAME.key_secret`."""
    server_key_file: str
    """The coordinator's public `NAME.key`."""

    @classmethod
    def from_options(
        cls, secret_key_file: str | None, server_key_file: str | None
    ) -> CurveClientKeys | None:
        """Both files or neither; each is read once here, so a bad file fails at once."""
        if secret_key_file is None and server_key_file is None:
            return None
        if secret_key_file is None or server_key_file is None:
            raise ValueError(
                "CURVE needs both curve_secret_key (this client's NAME.key_secret) and "
                "curve_server_key (the coordinator's public NAME.key)"
            )
        load_secret_key(secret_key_file)
        load_public_key(server_key_file)
        return cls(secret_key_file, server_key_file)

    @staticmethod
    def applies_to(address: str) -> bool:
        """Whether a socket connecting to `address` is made a CURVE client (tcp only)."""
        # The coordinator turns CURVE on for its tcp sockets only; a CURVE client
        # on ipc would fail its ZMTP handshake with a plain server.
        return address.startswith("tcp://")

    def apply(self, sock: zmq.Socket[Any], address: str) -> None:
        """Make `sock` a CURVE client if it is about to connect over TCP."""
        if self.applies_to(address):
            configure_client_socket(sock, self.secret_key_file, self.server_key_file)


# ---- why a handshake failed ------------------------------------------------------------------

#: Monitor events that end a ZMTP handshake, one way or the other.
HANDSHAKE_EVENTS: Final = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                           | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                           | zmq.EVENT_HANDSHAKE_FAILED_AUTH)

KEY_REFUSED: Final = "key_refused"
"""The coordinator's ZAP handler refused our CURVE key (status 400)."""
KEY_CHECK_FAILED: Final = "key_check_failed"
"""The coordinator's ZAP handler could not check our key (status 300 or 500)."""
CURVE_REQUIRED: Final = "curve_required"
"""We have no keys; the coordinator's socket requires CURVE."""
CURVE_NOT_OFFERED: Final = "curve_not_offered"
"""We use keys; the coordinator's socket has none."""
CURVE_DROPPED: Final = "curve_dropped"
"""The coordinator closed the connection during the CURVE handshake."""
HANDSHAKE_DROPPED: Final = "dropped"
"""The peer closed the connection during a handshake without CURVE."""
PROTOCOL_ERROR: Final = "protocol_error"
"""Any other ZMTP protocol error."""

# ZAP status codes (RFC 27): 300 temporary failure, 400 refused, 500 internal error.
_ZAP_TEMPORARY: Final = 300
_ZAP_INTERNAL: Final = 500
_KEY_OPTIONS: Final = ("--curve-secret-key and --curve-server-key on the command line, "
                       "curve_secret_key= and curve_server_key= in the SDKs")


@dataclass(frozen=True)
class HandshakeFailure:
    """Why the last ZMTP handshake of a connecting socket failed, in words."""

    kind: str
    """`KEY_REFUSED`, `KEY_CHECK_FAILED`, `CURVE_REQUIRED`, `CURVE_NOT_OFFERED`,
    `CURVE_DROPPED`, `HANDSHAKE_DROPPED` or `PROTOCOL_ERROR`."""
    message: str
    """What happened and what to change, naming the address."""
    final: bool
    """libzmq gave this connection up (it does not reconnect after a refusal or
    a protocol error): no answer will ever come on this socket."""


def _protocol_error_name(value: int) -> str:
    for name in dir(zmq):
        if name.startswith("PROTOCOL_ERROR_") and getattr(zmq, name) == value:
            return name[len("PROTOCOL_ERROR_"):].lower()
    return "unknown"


def describe_handshake_failure(
    event: int, value: int, *, address: str, curve: bool
) -> HandshakeFailure | None:
    """What a socket-monitor handshake event means for a client of the coordinator.

    `curve` says whether the socket is a CURVE client. None for events that are
    not handshake failures.
    """
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        if value in (_ZAP_TEMPORARY, _ZAP_INTERNAL):
            what = "a temporary failure" if value == _ZAP_TEMPORARY else "an internal error"
            return HandshakeFailure(
                KEY_CHECK_FAILED,
                f"the coordinator at {address} could not check our CURVE key (ZAP status "
                f"{value}, {what}); its log says why",
                final=True)
        return HandshakeFailure(
            KEY_REFUSED,
            f"the coordinator at {address} refused our CURVE key (ZAP status {value}): "
            "its client key directory (--curve-clients-dir) does not list this client's "
            "public key; copy this client's NAME.key there and restart the coordinator",
            final=True)
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH and not curve:
            return HandshakeFailure(
                CURVE_REQUIRED,
                f"the coordinator at {address} requires CURVE keys: give this client's "
                f"secret key file and the coordinator's public key file ({_KEY_OPTIONS})",
                final=True)
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return HandshakeFailure(
                CURVE_NOT_OFFERED,
                f"we use CURVE keys but the coordinator at {address} has no CURVE keys (it "
                "runs without --curve-secret-key): connect without keys, or start the "
                "coordinator with --curve-secret-key and --curve-clients-dir",
                final=True)
        return HandshakeFailure(
            PROTOCOL_ERROR,
            f"the ZMTP handshake with {address} failed with a protocol error "
            f"({_protocol_error_name(value)}, {value:#x}); is that a dp-coordinator socket?",
            final=True)
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        # The server closed first. It does so when it cannot read our CURVE hello (a
        # wrong server key), and also, racing its own greeting, when the mechanisms
        # differ; libzmq retries, and a mismatch is named once a retry sees it.
        if curve:
            return HandshakeFailure(
                CURVE_DROPPED,
                f"the coordinator at {address} closed the connection during the CURVE "
                "handshake: the server key file given (--curve-server-key, "
                "curve_server_key=) is most likely not this coordinator's public key, "
                "or the coordinator has no CURVE keys",
                final=False)
        maybe_curve = (f"it most likely requires CURVE keys ({_KEY_OPTIONS}), or "
                       if CurveClientKeys.applies_to(address) else "")
        return HandshakeFailure(
            HANDSHAKE_DROPPED,
            f"the peer at {address} closed the connection during the ZMTP handshake: "
            f"{maybe_curve}it is not a dp-coordinator socket, or it is stopping",
            final=False)
    return None


_monitor_ids = itertools.count(1)
_MONITOR_EVENT = struct.Struct("=HI")  # libzmq's first monitor frame: event id, value


class HandshakeMonitor:
    """How the ZMTP handshakes of one connecting socket end, from a libzmq socket monitor.

    `socket` is a plain (blocking-API) PAIR that receives the events; `poll()`
    reads what is pending without blocking and returns the latest failure not
    followed by a successful handshake. asyncio code waits on `socket` with a
    `zmq.asyncio.Poller`. `close()` before the context is terminated.
    """

    def __init__(self, sock: zmq.Socket[Any], address: str, *, curve: bool) -> None:
        self.address = address
        self.curve = curve
        #: The latest failure with no successful handshake since; None when there is none.
        self.failure: HandshakeFailure | None = None
        #: Whether any handshake of this socket succeeded.
        self.succeeded = False
        endpoint = f"inproc://dp-coordinator-monitor-{uuid.uuid4().hex}-{next(_monitor_ids)}"
        self._sock = sock
        sock.monitor(endpoint, HANDSHAKE_EVENTS)
        # A plain PAIR on the same libzmq context, so that sync and asyncio code alike
        # can read it without waiting.
        self.socket: zmq.Socket[bytes] = zmq.Context.shadow(sock.context.underlying).socket(
            zmq.PAIR)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        self._closed = False

    def record(self, frames: list[bytes]) -> HandshakeFailure | None:
        """Take one monitor message; the failure it reports, if it is one."""
        if len(frames) != 2 or len(frames[0]) != _MONITOR_EVENT.size:
            return None
        event, value = _MONITOR_EVENT.unpack(frames[0])
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.succeeded = True
            self.failure = None
            return None
        failure = describe_handshake_failure(event, value, address=self.address,
                                             curve=self.curve)
        if failure is not None:
            self.failure = failure
        return failure

    def poll(self) -> HandshakeFailure | None:
        """Read every pending event; the latest failure not followed by a success."""
        while not self._closed:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self.record(frames)
        return self.failure

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._sock.closed:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disable_monitor()
        self.socket.close(linger=0)


# ---- the event loop --------------------------------------------------------------------------

LOOP_CHOICES: Final = ("auto", "uvloop", "asyncio")


def run_loop(main: Coroutine[Any, Any, _T], loop: str = "auto") -> _T:
    """Run `main` on a new event loop until it returns; close the loop; return the result.

    `loop` is one of `LOOP_CHOICES`: "uvloop", "asyncio", or "auto" for uvloop when
    it is installed. Either loop runs the way `asyncio.run` does: tasks left over
    when `main` returns are cancelled, async generators and the default executor
    are shut down, and the loop is closed. "uvloop" without uvloop installed
    raises RuntimeError without running `main`.
    """
    if loop not in LOOP_CHOICES:
        main.close()
        raise ValueError(f"loop must be one of {', '.join(LOOP_CHOICES)}, got {loop!r}")
    if loop == "asyncio":
        return asyncio.run(main)
    try:
        import uvloop
    except ImportError:
        if loop == "uvloop":
            main.close()
            raise RuntimeError("--loop uvloop was asked for but uvloop is not installed") from None
        return asyncio.run(main)
    result: _T = uvloop.run(main)
    return result


# ---- child processes -------------------------------------------------------------------------

_PR_SET_PDEATHSIG: Final = 1

#: What a child started with `die_with_parent_preexec()` gets when its parent dies.
#: SIGTERM, not SIGKILL: every process this project starts (a coordinator, simulated
#: engines, a collective hub) handles SIGTERM by closing its sockets and removing its
#: ipc and address files, and exits at once; SIGKILL would leave those files behind.
PARENT_DEATH_SIGNAL: Final = signal.SIGTERM


def die_with_parent_preexec() -> Callable[[], None] | None:
    """A `preexec_fn` that makes the child get `PARENT_DEATH_SIGNAL` when its parent dies.

    Linux only (`PR_SET_PDEATHSIG`); None elsewhere or when libc has no `prctl`.
    libc is looked up here, in the parent, so the child only makes one call between
    fork and exec. Linux signals the child when the *thread* that started it ends,
    so start long-lived children from a thread that lives as long as they should.
    """
    if sys.platform != "linux":
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    death_signal = int(PARENT_DEATH_SIGNAL)

    def set_parent_death_signal() -> None:
        prctl(_PR_SET_PDEATHSIG, death_signal, 0, 0, 0)

    return set_parent_death_signal


# ---- the address file ------------------------------------------------------------------------


def endpoint_accepts_connections(endpoint: str, timeout_s: float = 0.5) -> bool:
    """Whether something accepts a connection at a ZeroMQ ipc or tcp endpoint now.

    A plain socket connects and closes at once (a ZeroMQ server takes that in
    its stride): an address file whose process died, whatever it left behind,
    fails here at once. Other transports count as accepting (nothing to check).
    """
    target: str | tuple[str, int]
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        # libzmq's "@name" is a name in Linux's abstract socket namespace.
        family, target = socket.AF_UNIX, "\0" + path[1:] if path.startswith("@") else path
    elif endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://"):].rpartition(":")
        host = host.strip("[]")
        if not port.isdigit() or host in ("", "*"):
            return False
        family, target = socket.AF_INET6 if ":" in host else socket.AF_INET, (host, int(port))
    else:
        return True
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.settimeout(timeout_s)
            probe.connect(target)
    except OSError:
        return False
    return True


class AddressFileTimeout(TimeoutError):
    """A coordinator's address file did not appear, whole and with every key, in time."""


def read_address_file(path: str, keys: Collection[str]) -> dict[str, str] | None:
    """The address file as a map, or None while it is missing, partial or lacks a key."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (FileNotFoundError, ValueError):
        return None
    if not isinstance(data, dict) or not all(key in data for key in keys):
        return None
    return {str(key): str(value) for key, value in data.items()}


def wait_for_address_file(
    path: str,
    keys: Collection[str],
    timeout_s: float,
    *,
    poll_s: float = 0.02,
    check: Callable[[], None] | None = None,
) -> dict[str, str]:
    """Wait until `path` holds every key in `keys`; return its addresses.

    A coordinator writes the file atomically once all its sockets are bound.
    `check` runs before every look and may raise to stop waiting (say, because the
    coordinator process exited). Raises AddressFileTimeout after `timeout_s`.
    Blocking: from a coroutine, run it in a thread (`asyncio.to_thread`).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if check is not None:
            check()
        addresses = read_address_file(path, keys)
        if addresses is not None:
            return addresses
        if time.monotonic() >= deadline:
            raise AddressFileTimeout(f"no usable address file at {path} after {timeout_s:g} s")
        time.sleep(poll_s)
