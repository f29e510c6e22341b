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
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import signal
import sys
import time
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
    "SocketRole",
    "bind",
    "configure_client_socket",
    "connect",
    "die_with_parent_preexec",
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

    def apply(self, sock: zmq.Socket[Any], address: str) -> None:
        """Make `sock` a CURVE client if it is about to connect over TCP."""
        # The coordinator turns CURVE on for its tcp sockets only; a CURVE client
        # on ipc would fail its ZMTP handshake with a plain server, silently.
        if address.startswith("tcp://"):
            configure_client_socket(sock, self.secret_key_file, self.server_key_file)


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
