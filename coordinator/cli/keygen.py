"""`dp-coordinator keygen`: write a CURVE key pair for the coordinator or a client.

Key files are the ZeroMQ certificate format (`NAME.key` public, `NAME.key_secret`
secret), interchangeable with czmq's and pyzmq's tools. The coordinator loads
its own secret key and a directory of its clients' public keys
(`coordinator.server.curve`); each client loads its secret key and the
coordinator's public key (`coordinator._zmq.CurveClientKeys`).
"""

from __future__ import annotations

import argparse
import os
import sys

import zmq.auth


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
