"""`serve --check`: every problem of a configuration that can be found without serving.

Nothing is bound for good, written or announced: ports are tried with a socket that
is closed at once, directories are asked whether they could hold a file, key files
are read. Each check adds the problems it finds to one list, so an operator sees
all of them at once instead of fixing one per start.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
from collections.abc import Iterator

from coordinator._zmq import load_secret_key
from coordinator.protocol.addresses import SOCKET_KEYS, bind_host
from coordinator.server.config import ServerConfig, check_host_resolves
from coordinator.server.curve import load_client_keys
from coordinator.server.fdlimit import ensure_descriptors
from coordinator.server.statefile import StateFileError, check_writable, load_state


def check_settings(config: ServerConfig) -> list[str]:
    """Every problem found in ``config``, each one line (empty: it would start)."""
    problems: list[str] = []
    try:
        config.validate()
    except ValueError as exc:
        problems.append(str(exc))
    if config.host is not None:
        try:
            check_host_resolves(config.host)
        except ValueError as exc:
            if str(exc) not in problems:
                problems.append(str(exc))
    problems += _state_file_problems(config.state_file)
    if config.addr_file is not None:
        problems += _directory_problems(config.addr_file, "--addr-file")
    if config.ipc_dir is not None and config.host is None:
        problems += _ipc_dir_problems(config.ipc_dir)
    problems += _curve_problems(config)
    problems += list(_port_problems(config))
    limit = ensure_descriptors(config.engines, config.frontends)
    if limit.refusal is not None:
        problems.append(f"not enough file descriptors: {limit.refusal}")
    return problems


def _state_file_problems(path: str | None) -> list[str]:
    if path is None:
        return []
    try:
        check_writable(path)
        load_state(path)  # a corrupt or newer file refuses to start
    except StateFileError as exc:
        return [str(exc)]
    return []


def _directory_problems(path: str, flag: str) -> list[str]:
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return [f"{flag} {path} is a directory"]
    if not os.path.isdir(directory):
        return [f"{flag} {path}: its directory {directory} does not exist"]
    if not os.access(directory, os.W_OK | os.X_OK):
        return [f"{flag} {path}: cannot create files in {directory} (permission denied)"]
    return []


def _ipc_dir_problems(path: str) -> list[str]:
    if os.path.isdir(path):
        if not os.access(path, os.W_OK | os.X_OK):
            return [f"--ipc-dir {path}: cannot create sockets there (permission denied)"]
        return []
    if os.path.exists(path):
        return [f"--ipc-dir {path} exists and is not a directory"]
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(parent):  # makedirs creates every missing level
        parent = os.path.dirname(parent)
    if not os.access(parent, os.W_OK | os.X_OK):
        return [f"--ipc-dir {path}: cannot create it in {parent} (permission denied)"]
    return []


def _curve_problems(config: ServerConfig) -> list[str]:
    problems: list[str] = []
    if config.curve_secret_key is not None:
        try:
            load_secret_key(config.curve_secret_key)
        except ValueError as exc:
            problems.append(f"--curve-secret-key: {exc}")
        else:
            mode = stat.S_IMODE(os.stat(config.curve_secret_key).st_mode)
            if mode & 0o077:
                problems.append(f"--curve-secret-key {config.curve_secret_key} can be read by "
                                f"its group or by everyone (mode {mode:o}): chmod 600 it")
    for flag, directory in (("--curve-clients-dir", config.curve_clients_dir),
                            ("--admin-keys-dir", config.admin_keys_dir)):
        if directory is None:
            continue
        try:
            keys = load_client_keys(directory)
        except ValueError as exc:
            problems.append(f"{flag}: {exc}")
            continue
        if not keys and flag == "--curve-clients-dir":
            problems.append(f"{flag} {directory}: no client public keys (*.key); every "
                            "engine and frontend would be refused")
    return problems


def _port_problems(config: ServerConfig) -> Iterator[str]:
    if config.host is not None and config.port_base is not None:
        host = bind_host(config.host)
        for index, key in enumerate(SOCKET_KEYS):
            if key in config.bind_overrides or host is None:
                continue
            reason = _port_taken(host, config.port_base + index)
            if reason is not None:
                yield f"socket {key}: port {config.port_base + index} on {host}: {reason}"
    for key, endpoint in config.bind_overrides.items():
        if not endpoint.startswith("tcp://"):
            continue
        host = bind_host(endpoint) or ""
        port_text = endpoint.rsplit(":", 1)[-1]
        if port_text.isdigit() and int(port_text) != 0:
            reason = _port_taken(host, int(port_text))
            if reason is not None:
                yield f"socket {key}: {endpoint}: {reason}"
    if config.metrics_port:
        reason = _port_taken(config.metrics_host, config.metrics_port)
        if reason is not None:
            yield f"--metrics-port {config.metrics_port} on {config.metrics_host}: {reason}"


def _port_taken(host: str, port: int) -> str | None:
    """Why ``port`` cannot be bound on ``host`` (None: it can, now)."""
    bind_to = "" if host in ("*", "0.0.0.0") else host
    try:
        infos = socket.getaddrinfo(bind_to or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError):
        return None  # an interface name, or a host the resolution check reports
    family, kind, proto, _, address = infos[0]
    probe = socket.socket(family, kind, proto)
    with contextlib.closing(probe):
        # As ZeroMQ binds: a port in TIME_WAIT is free.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
            probe.listen(1)
        except OSError as exc:
            return exc.strerror or str(exc)
    return None
