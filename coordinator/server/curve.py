"""CURVE on the coordinator's sockets: its key pair, and a ZAP check of client keys.

ZeroMQ has no authentication of its own: anyone who can reach a TCP port can
register as an engine, submit requests or read every rank's load. With CURVE
(elliptic-curve encryption and authentication, built into libzmq) the
coordinator loads its secret key and a directory of allowed client public keys;
`CurveServer` runs a ZAP handler (pyzmq's `ThreadAuthenticator`) that accepts
only those keys and counts every refusal. Clients make their sockets CURVE
clients with `coordinator._zmq.CurveClientKeys`; `dp-coordinator keygen` writes
the key files (the ZeroMQ certificate format: `NAME.key` public,
`NAME.key_secret` secret).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Final

import zmq
from zmq.auth.thread import ThreadAuthenticator

from coordinator._zmq import load_public_key, load_secret_key
from coordinator.server.transport import RateLimitedLog

log = logging.getLogger("coordinator.security")

DEFAULT_ZAP_DOMAIN: Final = "dp-coordinator"
REFUSED_UNKNOWN_KEY: Final = "unknown_key"


class CurveKeyError(ValueError):
    """The CURVE key files cannot be used: a configuration error, reported in one line."""


def load_client_keys(directory: str) -> frozenset[bytes]:
    """Every allowed client public key (``*.key`` files) in ``directory``."""
    if not os.path.isdir(directory):
        raise ValueError(f"client key directory {directory} does not exist")
    keys: set[bytes] = set()
    for entry in sorted(os.listdir(directory)):
        if entry.endswith(".key"):
            keys.add(load_public_key(os.path.join(directory, entry)))
    return frozenset(keys)


def warn_if_readable_by_others(secret_key_file: str) -> None:
    """A secret key others can read authenticates them as the coordinator."""
    try:
        mode = os.stat(secret_key_file).st_mode
    except OSError:
        return
    if mode & 0o077:
        log.warning("the CURVE secret key %s can be read by its group or by everyone "
                    "(mode %o): anyone who reads it can pose as the coordinator; "
                    "chmod 600 it", secret_key_file, mode & 0o777)


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
            logging.WARNING, "curve:unknown_key",
            "refused a CURVE client with public key %s: it is not in the allowed client key "
            "directory", key.decode("ascii", "replace"),
            extra={"event": "refused", "refused": "curve_client", "reason": REFUSED_UNKNOWN_KEY,
                   "public_key": key.decode("ascii", "replace")},
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
        admin_dir: str | None = None,
    ) -> None:
        self.context = context
        self.secret_key_file = secret_key_file
        self.clients_dir = clients_dir
        self.admin_dir = admin_dir
        self.domain = domain
        self.public_key, self._secret_key = load_secret_key(secret_key_file)
        warn_if_readable_by_others(secret_key_file)
        allowed = self._load_allowed()
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
        self._check.allowed = self._load_allowed()
        return len(self._check.allowed)

    def admin_keys(self) -> frozenset[str]:
        """Operators' keys (Z85 text, as the ZAP handler names a peer's ``User-Id``)."""
        if self.admin_dir is None:
            return frozenset()
        return frozenset(key.decode("ascii") for key in load_client_keys(self.admin_dir))

    def _load_allowed(self) -> frozenset[bytes]:
        # An operator's key is a client key too: it must be let in to be recognised.
        allowed = load_client_keys(self.clients_dir)
        if self.admin_dir is not None:
            allowed |= load_client_keys(self.admin_dir)
        return allowed

    def refusal_counts(self) -> dict[str, int]:
        """Refused CURVE clients by reason, since start (a copy; safe from any thread)."""
        with self._check.lock:
            return dict(self._check.refused)

    def counters(self, prefix: str = "refused.curve") -> dict[str, int]:
        """`refusal_counts` keyed for the server's counters (``refused.curve.<reason>``)."""
        return {f"{prefix}.{reason}": n for reason, n in self.refusal_counts().items()}
