"""Start a coordinator process beside a frontend and wait until it is serving.

    handle = launch(engines=4, frontends=1)
    handle.addresses["frontend"]   # where to connect
    handle.shutdown(timeout=5)

The child is `python -m coordinator serve ...`; the handle knows it is up once the
address file appears (written only after every socket is bound).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field

from coordinator._zmq import AddressFileTimeout, wait_for_address_file
from coordinator.protocol.addresses import SOCKET_KEYS


def stop_process(process: subprocess.Popen[bytes], timeout: float = 5.0) -> int:
    """SIGTERM, wait up to `timeout`, then SIGKILL; returns the exit code."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout)
    return int(process.returncode)


class LaunchError(RuntimeError):
    """The coordinator process did not come up."""


@dataclass
class CoordinatorHandle:
    process: subprocess.Popen[bytes]
    addresses: dict[str, str]
    addr_file: str
    _stderr_path: str = field(repr=False, default="")
    _tmpdir: str | None = field(repr=False, default=None)

    @property
    def pid(self) -> int:
        return self.process.pid

    def is_alive(self) -> bool:
        return self.process.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.process.poll()

    def stderr_text(self) -> str:
        with contextlib.suppress(OSError), open(self._stderr_path, errors="replace") as handle:
            return handle.read()
        return ""

    def shutdown(self, timeout: float = 5.0) -> int:
        """SIGTERM, wait up to `timeout`, then SIGKILL; returns the exit code."""
        code = stop_process(self.process, timeout)
        if self._tmpdir is not None:
            import shutil

            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None
        return code

    def __enter__(self) -> CoordinatorHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def launch(
    *,
    engines: int,
    frontends: int = 0,
    rank_start: int = 0,
    host: str | None = None,
    lockstep: bool = True,
    addr_file: str | None = None,
    extra_args: Sequence[str] = (),
    timeout: float = 30.0,
    log_level: str = "info",
    env: dict[str, str] | None = None,
) -> CoordinatorHandle:
    """Spawn `python -m coordinator serve` and wait for its address file."""
    tmpdir = None
    if addr_file is None:
        tmpdir = tempfile.mkdtemp(prefix="dp-coordinator-launch-")
        addr_file = os.path.join(tmpdir, "addresses.json")
    stderr_path = addr_file + ".stderr"
    args = [
        sys.executable, "-m", "coordinator", "serve",
        "--engines", str(engines),
        "--frontends", str(frontends),
        "--rank-start", str(rank_start),
        "--addr-file", addr_file,
        "--log-level", log_level,
    ]
    if host is not None:
        args += ["--host", host]
    if not lockstep:
        args.append("--no-wave-coordination")
    args += list(extra_args)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(addr_file)
    with open(stderr_path, "wb") as stderr:
        process = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr,
            env=env if env is not None else os.environ.copy(),
        )
    handle = CoordinatorHandle(process, {}, addr_file, stderr_path, tmpdir)

    def exited_early() -> None:
        if process.poll() is not None:
            raise LaunchError(
                f"coordinator exited with code {process.returncode} during start-up:\n"
                f"{handle.stderr_text()}"
            )

    try:
        handle.addresses = wait_for_address_file(addr_file, SOCKET_KEYS, timeout,
                                                 check=exited_early)
    except AddressFileTimeout:
        handle.shutdown(timeout=2.0)
        raise LaunchError(
            f"coordinator did not write {addr_file} within {timeout} s:\n{handle.stderr_text()}"
        ) from None
    return handle
