"""Who may talk to the coordinator: CURVE keys on TCP, and safe default binds.

ZeroMQ has no authentication of its own: anyone who can reach a TCP port can
register as an engine, submit requests, or read every rank's load. Two defences:

* Binds default to ipc or loopback. `check_bind_safety` refuses a non-loopback
  TCP bind unless CURVE keys are configured or the operator says `--insecure`.
* CURVE (elliptic-curve encryption and authentication, built into libzmq). Each
  side has a key pair made by `dp-coordinator keygen`. The coordinator loads its
  secret key and a directory of allowed client public keys; `CurveServer` runs a
  ZAP handler (pyzmq's `ThreadAuthenticator`) that accepts only those keys and
  counts every refusal. Clients (engines, frontends) call
  `configure_client_socket` with their own secret key and the coordinator's
  public key before connecting.

Key files are the ZeroMQ certificate format (`NAME.key` public, `NAME.key_secret`
secret), interchangeable with czmq's and pyzmq's tools.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
import threading
from typing import Any, Final

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from coordinator.server.transport import RateLimitedLog

log = logging.getLogger("coordinator.security")

DEFAULT_ZAP_DOMAIN: Final = "dp-coordinator"
Z85_KEY_LENGTH: Final = 40  # a 32-byte Curve25519 key in Z85
REFUSED_UNKNOWN_KEY: Final = "unknown_key"

_LOOPBACK_NAMES: Final = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


# ---- binds -----------------------------------------------------------------------------------


def bind_host(address: str) -> str | None:
    """The host part of a bind address, or None when it is not TCP (ipc, inproc).

    Takes a bare host (``0.0.0.0``, ``[::1]``, ``localhost``) or a ZeroMQ endpoint
    (``tcp://10.0.0.5:5555``, ``tcp://[::1]:0``, ``ipc:///tmp/x``).
    """
    if "://" in address:
        scheme, rest = address.split("://", 1)
        if scheme != "tcp":
            return None
        address = rest.rsplit(":", 1)[0] if rest.count(":") == 1 or "]" in rest else rest
    return address.strip("[]")


def is_loopback_host(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and localhost; names are not resolved."""
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind_safety(host: str | None, *, has_keys: bool, insecure: bool) -> None:
    """Refuse (ValueError) a non-loopback TCP bind without CURVE keys unless ``insecure``.

    ``host`` is what `--host` gave (None: ipc), a bare address, or a ZeroMQ endpoint.
    """
    if host is None or has_keys or insecure:
        return
    tcp_host = bind_host(host)
    if tcp_host is None or is_loopback_host(tcp_host):
        return
    raise ValueError(
        f"refusing to bind {host!r} without CURVE keys: it is not a loopback address, so "
        "any host that can reach it could register as an engine, submit requests and read "
        "every rank's load (ZeroMQ does no authentication by itself). Either configure "
        "keys with --curve-secret-key and --curve-clients-dir (make them with "
        "`dp-coordinator keygen`), bind 127.0.0.1 or ipc (the default), or pass "
        "--insecure if only trusted hosts can reach this network."
    )


# ---- key files -------------------------------------------------------------------------------


def generate_keypair(directory: str, name: str, *, overwrite: bool = False) -> tuple[str, str]:
    """Write ``directory/name.key`` (public) and ``name.key_secret`` (mode 0600).

    Returns ``(public_path, secret_path)``. Refuses to replace existing files
    unless ``overwrite``: replacing a key pair locks out whoever holds the old one.
    """
    if not name or os.sep in name or (os.altsep and os.altsep in name) or name in (".", ".."):
        raise ValueError(f"key name must be a plain file name, got {name!r}")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    base = os.path.join(directory, name)
    if not overwrite:
        for path in (base + ".key", base + ".key_secret"):
            if os.path.exists(path):
                raise FileExistsError(f"{path} already exists (use --force to replace it)")
    # Make the secret file private before any key material is written to it.
    secret_path = base + ".key_secret"
    fd = os.open(secret_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.close(fd)
    os.chmod(secret_path, 0o600)
    public_path, secret_path = zmq.auth.create_certificates(directory, name)
    os.chmod(secret_path, 0o600)
    return public_path, secret_path


def load_secret_key(path: str) -> tuple[bytes, bytes]:
    """``(public, secret)`` Z85 keys from a secret key file; ValueError if it is not one."""
    public, secret = _load(path)
    if secret is None:
        raise ValueError(
            f"{path} holds only a public key; give the secret key file "
            "(NAME.key_secret, made by `dp-coordinator keygen`)"
        )
    return public, secret


def load_public_key(path: str) -> bytes:
    """The Z85 public key of a key file (public or secret)."""
    return _load(path)[0]


def _load(path: str) -> tuple[bytes, bytes | None]:
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


def load_client_keys(directory: str) -> frozenset[bytes]:
    """Every allowed client public key (``*.key`` files) in ``directory``."""
    if not os.path.isdir(directory):
        raise ValueError(f"client key directory {directory} does not exist")
    keys: set[bytes] = set()
    for entry in sorted(os.listdir(directory)):
        if entry.endswith(".key"):
            keys.add(load_public_key(os.path.join(directory, entry)))
    return frozenset(keys)


# ---- server side -----------------------------------------------------------------------------


class _KeyCheck:
    """The ZAP credentials callback: allowed keys in, refusals counted (auth thread)."""

    def __init__(self, allowed: frozenset[bytes], ratelog: RateLimitedLog) -> None:
        self.allowed = allowed
        self.refused: dict[str, int] = {}
        self.lock = threading.Lock()
        self._ratelog = ratelog

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.allowed:
            return True
        with self.lock:
            self.refused[REFUSED_UNKNOWN_KEY] = self.refused.get(REFUSED_UNKNOWN_KEY, 0) + 1
        self._ratelog.log(
            logging.WARNING, f"curve:{key!r}",
            "refused a CURVE client with public key %s: it is not in the allowed client key "
            "directory", key.decode("ascii", "replace"),
        )
        return False


class CurveServer:
    """CURVE for the coordinator's sockets: its key pair and a ZAP handler for client keys.

    One per zmq context (ZAP is bound once per context). `start()` before any
    socket is configured; `configure_socket()` before the socket binds.
    """

    def __init__(
        self,
        context: zmq.Context[Any],
        secret_key_file: str,
        clients_dir: str,
        *,
        domain: str = DEFAULT_ZAP_DOMAIN,
        log_interval_s: float = 5.0,
    ) -> None:
        self.context = context
        self.secret_key_file = secret_key_file
        self.clients_dir = clients_dir
        self.domain = domain
        self.public_key, self._secret_key = load_secret_key(secret_key_file)
        allowed = load_client_keys(clients_dir)
        if not allowed:
            raise ValueError(
                f"no client public keys (*.key) in {clients_dir}: every engine and frontend "
                "would be refused. Copy the clients' NAME.key files there "
                "(make them with `dp-coordinator keygen`)."
            )
        self._check = _KeyCheck(allowed, RateLimitedLog(log, interval_s=log_interval_s))
        self._auth: ThreadAuthenticator | None = None

    @property
    def allowed_clients(self) -> int:
        return len(self._check.allowed)

    @property
    def started(self) -> bool:
        return self._auth is not None

    def start(self) -> None:
        if self._auth is not None:
            return
        auth = ThreadAuthenticator(self.context, log=logging.getLogger("coordinator.zap"))
        auth.start()
        auth.configure_curve_callback(self.domain, credentials_provider=self._check)
        self._auth = auth
        log.info("CURVE on: %d allowed client keys from %s", self.allowed_clients,
                 self.clients_dir)

    def stop(self) -> None:
        auth, self._auth = self._auth, None
        if auth is not None:
            auth.stop()

    def __enter__(self) -> CurveServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def configure_socket(self, sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` a CURVE server that asks our ZAP handler about every client."""
        if self._auth is None:
            # Without a ZAP handler libzmq would let any CURVE client in.
            raise RuntimeError("CurveServer.start() must run before sockets are configured")
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self._secret_key)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public_key)
        sock.setsockopt_string(zmq.ZAP_DOMAIN, self.domain)
        # Refuse clients outright if the ZAP handler is ever unreachable.
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)

    def reload_clients(self) -> int:
        """Re-read the client key directory (e.g. on SIGHUP); returns how many keys."""
        self._check.allowed = load_client_keys(self.clients_dir)
        return len(self._check.allowed)

    def refusal_counts(self) -> dict[str, int]:
        """Refused CURVE clients by reason, since start (a copy; safe from any thread)."""
        with self._check.lock:
            return dict(self._check.refused)

    def counters(self, prefix: str = "refused.curve") -> dict[str, int]:
        """`refusal_counts` keyed for the server's counters (``refused.curve.<reason>``)."""
        return {f"{prefix}.{reason}": n for reason, n in self.refusal_counts().items()}


# ---- client side -----------------------------------------------------------------------------


def configure_client_socket(
    sock: zmq.Socket[Any], client_secret_file: str, server_public_file: str
) -> None:
    """Make ``sock`` a CURVE client of the coordinator (call before connect)."""
    public, secret = load_secret_key(client_secret_file)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SERVERKEY, load_public_key(server_public_file))


# ---- command line ----------------------------------------------------------------------------


def add_curve_arguments(parser: argparse.ArgumentParser) -> None:
    """The `serve` flags for CURVE and for binding beyond loopback."""
    group = parser.add_argument_group("security")
    group.add_argument("--curve-secret-key", default=None, metavar="FILE",
                       help="the coordinator's secret key file (NAME.key_secret): turns on "
                       "CURVE encryption and authentication on every TCP socket")
    group.add_argument("--curve-clients-dir", default=None, metavar="DIR",
                       help="directory of allowed client public keys (*.key); others are "
                       "refused and counted")
    group.add_argument("--insecure", action="store_true",
                       help="allow binding a non-loopback TCP address without CURVE keys")


def add_keygen_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "keygen",
        help="write a CURVE key pair",
        description="Write a CURVE key pair for the coordinator or one of its clients: "
        "DIR/NAME.key (public: copy it to the other side) and DIR/NAME.key_secret "
        "(secret: stays where it is, mode 0600).",
        epilog="Typical use: `keygen --dir keys --name coordinator` once, give "
        "keys/coordinator.key_secret to `serve --curve-secret-key`, and "
        "keys/coordinator.key to every client; `keygen --name <client>` per engine or "
        "frontend, and put each client's .key file into the coordinator's "
        "--curve-clients-dir.",
    )
    p.add_argument("--dir", required=True, metavar="D", help="directory for the key files "
                   "(created with mode 0700 if missing)")
    p.add_argument("--name", required=True, metavar="N", help="base name of the key files")
    p.add_argument("--force", action="store_true", help="replace existing key files")


def run_keygen(args: argparse.Namespace) -> int:
    try:
        public, secret = generate_keypair(args.dir, args.name, overwrite=args.force)
    except (OSError, ValueError) as exc:
        print(f"dp-coordinator keygen: {exc}", file=sys.stderr)
        return 1
    print(f"public key: {public}  (share it)")
    print(f"secret key: {secret}  (keep it private)")
    return 0
