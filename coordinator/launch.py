"""Start a coordinator process beside a frontend and wait until it is serving.

    handle = launch(engines=4, frontends=1)
    handle.addresses["frontend"]   # where to connect
    handle.shutdown(timeout=5)

The child is `python -m coordinator serve ...`; the handle knows it is up once the
address file appears (written only after every socket is bound).

Stopping never raises: SIGTERM, a wait of `timeout` but at least a short grace
(a coordinator stops in milliseconds, and one that gets the chance closes its
sockets and removes its files), then SIGKILL. Whatever the child could not
clean up, the launch directory goes with the handle.

Discovery. A coordinator started for someone else (vLLM's launcher, through
the drop-in) has its address file in a private launch directory. A copy is
published as `dp-coordinator-<deployment>.json` in `discovery_dir()`: vLLM's
RPC base path (`VLLM_RPC_BASE_PATH`, else the temporary directory), where vLLM
puts its own ipc sockets. `find_coordinators()` lists those files and says
which ones still answer, so the operator tools find a coordinator with no
arguments on its host.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

from coordinator._zmq import (
    AddressFileTimeout,
    endpoint_accepts_connections,
    read_address_file,
    wait_for_address_file,
)
from coordinator.protocol.addresses import SOCKET_KEYS

SIGTERM_GRACE_S: Final = 2.0
"""The shortest wait between SIGTERM and SIGKILL, whatever `timeout` says.

vLLM's `vllm serve` stops its coordinator with `shutdown(timeout=0)` by
default; a coordinator that gets this long exits cleanly instead of being
killed with its files left behind."""

KILL_WAIT_S: Final = 5.0
"""How long to wait for a SIGKILLed child to be reaped (only a process stuck in
the kernel takes longer)."""

STDERR_TAIL_BYTES: Final = 64 * 1024
"""How much of the child's log a handle keeps once its launch directory is gone."""

LAUNCHER_FLAGS: Final = (
    "--engines", "--frontends", "--rank-start", "--addr-file", "--host",
    "--no-wave-coordination",
)
"""`serve` flags `launch` sets from its keywords; `extra_args` may not repeat them."""

_IPC_DIR_MAX: Final = 80
"""Longest own ipc directory: a unix socket path holds 108 bytes with the key."""


def stop_process(
    process: subprocess.Popen[bytes], timeout: float | None = 5.0, *,
    grace: float = SIGTERM_GRACE_S,
) -> int | None:
    """SIGTERM, wait up to `max(timeout, grace)`, then SIGKILL; the exit code.

    Never raises. `timeout` None means 5 s. The result is None only when even
    a SIGKILLed child was not reaped within `KILL_WAIT_S`.
    """
    wait_s = max(5.0 if timeout is None else timeout, grace, 0.0)
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(wait_s)
    if process.poll() is None:
        # Stopped (SIGSTOP), wedged or ignoring SIGTERM: SIGKILL works on all of them.
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(KILL_WAIT_S)
    return process.poll()


class LaunchError(RuntimeError):
    """The coordinator process did not come up."""


class LauncherFlagError(ValueError):
    """Extra `serve` flags `serve` would refuse, or that repeat one the launcher sets."""


SERVE_OPTIONS: Final = frozenset({
    "--addr-file", "--bind", "--coord-store-port", "--curve-clients-dir", "--curve-secret-key",
    "--engines", "--frontends", "--handshake-timeout-s", "--heartbeat-s", "--help", "--host",
    "--insecure", "--ipc-dir", "--kv-block-size", "--kv-events-endpoint",
    "--kv-events-replay-endpoint", "--lease-ttl-s", "--log-level", "--loop", "--master-ip",
    "--master-port", "--metrics-host", "--metrics-port", "--no-watchdog-rewake",
    "--no-wave-coordination", "--policy", "--port-base", "--prefix-slack-tokens",
    "--publish-interval-ms", "--rank-start", "--recorder-size", "--state-file", "--vllm-compat",
    "--watchdog-stall-s", "--max-engine-message-bytes", "--max-request-bytes", "--admin-keys-dir",
    "--min-engines", "--max-engines", "--frontend-lease-ttl-s", "--frontend-wake",
    "--require-supported-vllm", "--config", "--check", "--log-format",
    "--graceful-stop-s",
    "--kv-bootstrap-port", "--kv-bootstrap-host",
    "--kv-bootstrap-tp-size", "--kv-bootstrap-pp-size", "--kv-bootstrap-probe-timeout-s",
})
"""Every long option of `dp-coordinator serve`, which argparse matches by unique prefix.

Written out rather than read from the command-line parser so that the launch API
does not import the command line (which imports it); a test keeps the two equal."""


def serve_option_names() -> frozenset[str]:
    """Every long option `dp-coordinator serve` accepts."""
    return SERVE_OPTIONS


def find_flags(
    args: Sequence[str], wanted: Iterable[str], known: Iterable[str] | None = None
) -> list[tuple[str, str]]:
    """`(flag, as written)` for each of `args` that `serve` would read as a `wanted` flag.

    Catches every spelling argparse accepts: `--addr-file F`, `--addr-file=F`
    and unambiguous abbreviations such as `--addr F`. `known` is every option
    of `serve` (`SERVE_OPTIONS` when not given).
    """
    wanted = frozenset(wanted)
    options = frozenset(serve_option_names() if known is None else known) | wanted
    found: list[tuple[str, str]] = []
    for arg in args:
        if arg == "--":
            break  # argparse reads no options after it
        if not arg.startswith("--") or len(arg) < 3:
            continue
        name = arg.partition("=")[0]
        if name in options:
            flag = name
        else:
            matches = [option for option in options if option.startswith(name)]
            if len(matches) != 1:
                continue  # unknown or ambiguous: `serve` refuses it itself, with a message
            flag = matches[0]
        if flag in wanted:
            found.append((flag, arg))
    return found


def unknown_flags(args: Sequence[str], known: Iterable[str] | None = None) -> list[str]:
    """Each of `args` that `serve` would refuse as an option: a `--name` that is neither
    one of its options nor an unambiguous abbreviation of one (`--` ends the options)."""
    options = frozenset(serve_option_names() if known is None else known)
    unknown: list[str] = []
    for arg in args:
        if arg == "--":
            break
        if not arg.startswith("--") or len(arg) < 3:
            continue
        name = arg.partition("=")[0]
        if name not in options and sum(o.startswith(name) for o in options) != 1:
            unknown.append(arg)
    return unknown


def describe_flags(found: Sequence[tuple[str, str]]) -> str:
    """`--addr-file (given as --addr-file=x.json), --engines` for an error message."""
    return ", ".join(flag if flag == written else f"{flag} (given as {written})"
                     for flag, written in found)


def _tail(text: str, limit: int = 4000) -> str:
    return text if len(text) <= limit else "...\n" + text[-limit:]


@dataclass
class CoordinatorHandle:
    process: subprocess.Popen[bytes]
    addresses: dict[str, str]
    addr_file: str
    _stderr_path: str = field(repr=False, default="")
    _tmpdir: str | None = field(repr=False, default=None)
    _stderr_kept: str | None = field(repr=False, default=None)

    @property
    def pid(self) -> int:
        return self.process.pid

    def is_alive(self) -> bool:
        return self.process.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.process.poll()

    def stderr_text(self) -> str:
        """The child's log; after shutdown removed the launch directory, its last 64 KiB."""
        if self._stderr_kept is not None:
            return self._stderr_kept
        with contextlib.suppress(OSError), open(self._stderr_path, errors="replace") as handle:
            return handle.read()
        return ""

    def stderr_tail(self, limit: int = 4000) -> str:
        """The end of the child's log, for error messages; never empty."""
        text = self.stderr_text().strip()
        return _tail(text, limit) if text else "(the coordinator wrote nothing to stderr)"

    def shutdown(self, timeout: float | None = 5.0) -> int | None:
        """Stop the child (see `stop_process`) and remove the launch directory.

        Never raises, and may be called again. Returns the exit code: 0 for a
        clean stop, a negative signal number for a killed child.
        """
        try:
            return stop_process(self.process, timeout)
        finally:
            self._remove_launch_dir()

    def _remove_launch_dir(self) -> None:
        if self._tmpdir is None:
            return
        with contextlib.suppress(OSError), open(self._stderr_path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - STDERR_TAIL_BYTES))
            self._stderr_kept = handle.read().decode(errors="replace")
        shutil.rmtree(self._tmpdir, ignore_errors=True)
        self._tmpdir = None

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
    """Spawn `python -m coordinator serve` and wait for its address file.

    `extra_args` go after the launcher's own flags (so `--log-level` there wins
    over `log_level`); a flag of `LAUNCHER_FLAGS` there raises
    `LauncherFlagError` at once, since a second copy would contradict a
    keyword. Start-up failures raise `LaunchError` with the end of the
    child's log.
    """
    owned = find_flags(extra_args, LAUNCHER_FLAGS)
    if owned:
        raise LauncherFlagError(
            f"extra_args repeat flags that launch() sets from its keywords: "
            f"{describe_flags(owned)}; use the keywords engines, frontends, rank_start, "
            f"addr_file, host and lockstep instead"
        )
    tmpdir = None
    args_tail = list(extra_args)
    if addr_file is None:
        tmpdir = tempfile.mkdtemp(prefix="dp-coordinator-launch-")
        addr_file = os.path.join(tmpdir, "addresses.json")
        ipc_dir = os.path.join(tmpdir, "ipc")
        if host is None and len(ipc_dir) <= _IPC_DIR_MAX and not find_flags(
            extra_args, ("--ipc-dir",)
        ):
            # In the launch directory, so even a killed child leaves no socket files.
            args_tail = ["--ipc-dir", ipc_dir, *args_tail]
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
    args += args_tail
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(addr_file)
        with open(stderr_path, "wb") as stderr:
            process = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr,
                env=env if env is not None else os.environ.copy(),
            )
    except BaseException:
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)
        raise
    handle = CoordinatorHandle(process, {}, addr_file, stderr_path, tmpdir)

    def exited_early() -> None:
        if process.poll() is not None:
            raise LaunchError(
                f"the coordinator exited with code {process.returncode} during start-up"
            )

    try:
        handle.addresses = wait_for_address_file(addr_file, SOCKET_KEYS, timeout,
                                                 check=exited_early)
    except AddressFileTimeout:
        handle.shutdown(timeout=2.0)
        raise LaunchError(
            f"the coordinator did not write {addr_file} within {timeout:g} s; its log "
            f"ends:\n{handle.stderr_tail()}"
        ) from None
    except BaseException as exc:
        handle.shutdown(timeout=2.0)
        if isinstance(exc, LaunchError):
            raise LaunchError(f"{exc}; its log ends:\n{handle.stderr_tail()}") from None
        raise
    return handle


# ---- discovery -------------------------------------------------------------------------------

DISCOVERY_PREFIX: Final = "dp-coordinator-"
DISCOVERY_SUFFIX: Final = ".json"


def discovery_dir() -> str:
    """Where published address files go: vLLM's RPC base path, as vLLM 0.33 chooses it.

    `VLLM_RPC_BASE_PATH` when set, else the temporary directory (`TMPDIR`, else /tmp).
    """
    return os.environ.get("VLLM_RPC_BASE_PATH") or tempfile.gettempdir()


def discovery_path(deployment: str, directory: str | None = None) -> str:
    """`<directory>/dp-coordinator-<deployment>.json` (directory: `discovery_dir()`)."""
    if not deployment or os.sep in deployment or deployment.startswith("."):
        raise ValueError(f"a deployment name must be a plain file name part, got {deployment!r}")
    return os.path.join(directory or discovery_dir(),
                        f"{DISCOVERY_PREFIX}{deployment}{DISCOVERY_SUFFIX}")


@dataclass(frozen=True)
class PublishedAddresses:
    """An address file published for discovery; `remove()` deletes it if it is still ours."""

    path: str
    device: int
    inode: int

    def remove(self) -> None:
        """Delete the file unless another coordinator has replaced it since. Never raises."""
        with contextlib.suppress(OSError):
            status = os.stat(self.path)
            if (status.st_dev, status.st_ino) == (self.device, self.inode):
                os.unlink(self.path)


def publish_addresses(
    addresses: dict[str, str], deployment: str, *, fallback: str,
    directory: str | None = None,
) -> PublishedAddresses | None:
    """Publish `addresses` as `discovery_path(deployment)`; None if that cannot be done.

    A file of that name whose coordinator still answers is left alone, as is one
    this user may not replace (another user's, in a shared /tmp): the copy is
    then named after `deployment-fallback`. Written atomically, so readers never
    see half a file. Never raises: discovery is a convenience, start-up goes on.
    """
    for name in (deployment, f"{deployment}-{fallback}"):
        try:
            path = discovery_path(name, directory)
        except ValueError:
            return None
        existing = read_address_file(path, ("frontend",))
        if existing is not None and endpoint_accepts_connections(existing["frontend"]):
            continue
        published = _write_atomically(path, addresses)
        if published is not None:
            return published
    return None


def _write_atomically(path: str, addresses: dict[str, str]) -> PublishedAddresses | None:
    try:
        fd, tmp = tempfile.mkstemp(prefix=".dp-coordinator-", dir=os.path.dirname(path))
    except OSError:
        return None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(addresses, handle, indent=2, sort_keys=True)
            handle.write("\n")
        os.replace(tmp, path)
        status = os.stat(path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return None
    return PublishedAddresses(path, status.st_dev, status.st_ino)


@dataclass(frozen=True)
class FoundCoordinator:
    """A published address file and whether its coordinator answers."""

    path: str
    addresses: dict[str, str]
    answering: bool
    """Something accepts connections at its `frontend` address."""


def find_coordinators(directory: str | None = None, *,
                      probe_timeout_s: float = 0.5) -> list[FoundCoordinator]:
    """Every published address file in `directory` (`discovery_dir()`), by path."""
    pattern = os.path.join(glob.escape(directory or discovery_dir()),
                           f"{DISCOVERY_PREFIX}*{DISCOVERY_SUFFIX}")
    found = []
    for path in sorted(glob.glob(pattern)):
        addresses = read_address_file(path, SOCKET_KEYS)
        if addresses is None:
            continue  # not an address file (or a partial one): not ours to judge
        answering = endpoint_accepts_connections(addresses["frontend"], probe_timeout_s)
        found.append(FoundCoordinator(path, addresses, answering))
    return found
