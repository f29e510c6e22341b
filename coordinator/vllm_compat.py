"""Run this coordinator where vLLM 0.33's launcher expects its own `DPCoordinator`.

vLLM's rank-0 launcher (`launch_core_engines`) builds one coordinator object and
touches nothing else of it than this:

* the constructor, called as ``DPCoordinator(parallel_config,
  enable_wave_coordination=..., logging_config=...)``;
* ``get_engine_socket_addresses()``, giving ``(coordinator_input,
  coordinator_output)`` for the engines' INIT, that is our ``back_publish`` and
  ``back_output``;
* ``get_stats_publish_address()``, given to every API server: our ``front_publish``;
* ``.proc``: its ``pid`` is logged; its ``sentinel`` is waited on together with
  the engines' and API servers' sentinels (a ZeroMQ poller during start-up,
  ``multiprocessing.connection.wait`` afterwards), then ``name`` and
  ``exitcode`` say who died and how;
* ``_coord_store``: elastic EP parks its TCPStore there to keep it alive;
* ``shutdown(timeout)``.

`DPCoordinatorProcess` offers exactly that surface on top of
`coordinator.launch.launch`, so the process underneath is the ordinary
``python -m coordinator serve``. `coordinator.vllm_plugin` swaps it in for
vLLM's class.

Transports. vLLM picks ipc or tcp per socket (`plan_transports` holds its
rule); ``serve`` binds all of its sockets with one transport. When the rule
asks for a mix, every socket is bound on ``tcp://<data_parallel_master_ip>:0``.
That changes nothing for the peers: each one connects to the address it is
handed. The front publish socket would be ipc because in internal-LB mode every
API server runs on the coordinator's host, and those API servers reach the tcp
address on that host just as well; the back sockets would be ipc because every
engine is local, and local engines reach it too. The cost is a tcp hop on the
local host instead of ipc, and sockets that other hosts able to reach the
master ip can reach too; in every mixed layout vLLM already binds one of its
coordinator sockets there.

Discovery. The child's address file lives in its private launch directory; a
copy is published as ``dp-coordinator-<data_parallel_master_port>.json`` under
vLLM's RPC base path (`coordinator.launch.discovery_dir`), so ``dp-coordinator
status`` and ``top`` find the coordinator on this host with no arguments. The
copy goes at shutdown.

Nothing here imports vLLM.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import BinaryIO, Final

from coordinator.launch import (
    LAUNCHER_FLAGS,
    CoordinatorHandle,
    LauncherFlagError,
    PublishedAddresses,
    describe_flags,
    find_flags,
    launch,
    publish_addresses,
    serve_option_names,
    unknown_flags,
)
from coordinator.protocol.addresses import is_loopback_host

__all__ = [
    "DEFAULT_STARTUP_TIMEOUT_S",
    "DROPIN_FLAGS",
    "EXTRA_ARGS_ENV",
    "IPC",
    "PROCESS_NAME",
    "ROUTE_ADDRESS_ENV",
    "TCP",
    "CoordinatorProcess",
    "DPCoordinatorProcess",
    "ParallelSettings",
    "TransportPlan",
    "open_exit_sentinel",
    "plan_transports",
    "resolve_parallel_settings",
]

IPC: Final = "ipc"
TCP: Final = "tcp"

PROCESS_NAME: Final = "dp-coordinator"
"""`.proc.name`: vLLM's launcher prints it when the process dies."""

DEFAULT_STARTUP_TIMEOUT_S: Final = 120.0
"""How long vLLM 0.33 waits for its own coordinator to report its addresses."""

EXTRA_ARGS_ENV: Final = "DP_COORDINATOR_SERVE_ARGS"
"""Extra `serve` flags (shell syntax), for deployments that cannot pass arguments."""

ROUTE_ADDRESS_ENV: Final = "DP_COORDINATOR_ROUTE_ADDRESS"
"""Set to the coordinator's `frontend` address for the processes started after it
(`coordinator.vllm_plugin.ROUTE_ADDRESS_ENV`, where the plugin route reads it)."""

_LOG_LEVELS: Final = {
    "debug": "debug",
    "info": "info",
    "warning": "warning",
    "warn": "warning",
    "error": "error",
    "critical": "error",
}


# ---- parallel settings and the transport rule -------------------------------------------


@dataclass(frozen=True)
class ParallelSettings:
    """The parts of vLLM's ParallelConfig that shape the coordinator."""

    data_parallel_size: int
    data_parallel_master_ip: str = "127.0.0.1"
    data_parallel_size_local: int | None = None
    """Engines on the coordinator's node; None means all of them."""
    local_engines_only: bool = False
    """vLLM's name for "external or hybrid load balancing": each API server
    manages only its own node's engines and may run on another node."""
    enable_elastic_ep: bool = False
    elastic_ep_max_dp_size: int | None = None
    """vLLM's bound on elastic EP's data_parallel_size (None: data_parallel_size)."""
    data_parallel_master_port: int | None = None
    """The torch DP meeting point's port; it names the published address file."""

    @property
    def engines_all_local(self) -> bool:
        local = self.data_parallel_size_local
        return local is None or local == self.data_parallel_size

    def validate(self) -> None:
        size = self.data_parallel_size
        if type(size) is not int or not 1 <= size <= 65536:
            raise ValueError(f"data_parallel_size must be an int in [1, 65536], got {size!r}")
        local = self.data_parallel_size_local
        if local is not None and (type(local) is not int or not 0 <= local <= size):
            raise ValueError(
                f"data_parallel_size_local must be an int in [0, {size}], got {local!r}"
            )
        if not self.data_parallel_master_ip:
            raise ValueError("data_parallel_master_ip must not be empty")
        port = self.data_parallel_master_port
        if port is not None and (type(port) is not int or not 0 <= port <= 65535):
            raise ValueError(f"data_parallel_master_port must be an int in [0, 65535], "
                             f"got {port!r}")


def resolve_parallel_settings(
    parallel_config: object | None = None,
    *,
    data_parallel_size: int | None = None,
    data_parallel_master_ip: str | None = None,
    data_parallel_size_local: int | None = None,
    local_engines_only: bool | None = None,
    data_parallel_external_lb: bool | None = None,
    data_parallel_hybrid_lb: bool | None = None,
    enable_elastic_ep: bool | None = None,
    data_parallel_master_port: int | None = None,
) -> ParallelSettings:
    """Settings from a ParallelConfig-like object, each overridden by a keyword if given.

    The object is read by attribute name only (vLLM's `ParallelConfig`, an
    `argparse.Namespace`, anything). `local_engines_only` is vLLM's property;
    without it, `data_parallel_external_lb or data_parallel_hybrid_lb` stands in.
    """

    def pick(explicit: object, name: str, default: object) -> object:
        if explicit is not None:
            return explicit
        return getattr(parallel_config, name, default)

    size = pick(data_parallel_size, "data_parallel_size", None)
    if size is None:
        raise ValueError("data_parallel_size is required (a keyword or parallel_config)")
    if local_engines_only is None and (
        data_parallel_external_lb is not None or data_parallel_hybrid_lb is not None
    ):
        local_engines_only = bool(data_parallel_external_lb) or bool(data_parallel_hybrid_lb)
    lb_default = bool(getattr(parallel_config, "data_parallel_external_lb", False)) or bool(
        getattr(parallel_config, "data_parallel_hybrid_lb", False)
    )
    settings = ParallelSettings(
        data_parallel_size=size,  # type: ignore[arg-type]  # checked by validate()
        data_parallel_master_ip=str(
            pick(data_parallel_master_ip, "data_parallel_master_ip", "127.0.0.1")
        ),
        data_parallel_size_local=pick(  # type: ignore[arg-type]
            data_parallel_size_local, "data_parallel_size_local", None
        ),
        local_engines_only=bool(pick(local_engines_only, "local_engines_only", lb_default)),
        enable_elastic_ep=bool(pick(enable_elastic_ep, "enable_elastic_ep", False)),
        elastic_ep_max_dp_size=getattr(parallel_config, "elastic_ep_max_dp_size", None),
        data_parallel_master_port=pick(  # type: ignore[arg-type]  # checked by validate()
            data_parallel_master_port, "data_parallel_master_port", None
        ),
    )
    settings.validate()
    return settings


@dataclass(frozen=True)
class TransportPlan:
    """Which transport vLLM 0.33 would use for each coordinator socket, and what we bind."""

    front_publish: str
    """IPC or TCP for the front publish socket."""
    back: str
    """IPC or TCP for back_publish and back_output (vLLM has one rule for both)."""
    master_ip: str

    @property
    def mixed(self) -> bool:
        return self.front_publish != self.back

    @property
    def bind_host(self) -> str | None:
        """`serve --host`: None (ipc) only if vLLM would use ipc for every socket."""
        if self.front_publish == IPC and self.back == IPC:
            return None
        return self.master_ip


def plan_transports(settings: ParallelSettings) -> TransportPlan:
    """vLLM 0.33's rule (spec 1.2).

    Front publish: ipc in internal-LB mode, where every API server shares the
    coordinator's host; tcp on the master ip in hybrid or external LB, where API
    servers run on other nodes. Back sockets: ipc only if every engine is on
    this node and elastic EP (which may add remote engines later) is off.
    """
    front = TCP if settings.local_engines_only else IPC
    back = IPC if settings.engines_all_local and not settings.enable_elastic_ep else TCP
    return TransportPlan(front, back, settings.data_parallel_master_ip)


# ---- the child process as vLLM's launcher sees it ---------------------------------------


def open_exit_sentinel(
    process: subprocess.Popen[bytes], *, prefer_pidfd: bool = True
) -> tuple[int, Callable[[], None]]:
    """A file descriptor that becomes readable once `process` has exited, and its closer.

    It works with `multiprocessing.connection.wait`, `select` and ZeroMQ pollers,
    like a `multiprocessing.Process.sentinel`. A pidfd (Linux 5.3+) needs no
    thread; elsewhere a pipe is closed by a thread that waits for the process.
    """
    pidfd_open: Callable[[int], int] | None = getattr(os, "pidfd_open", None)
    if prefer_pidfd and pidfd_open is not None:
        try:
            # The child is not reaped before someone polls it, so its pid cannot
            # have been reused yet.
            fd = pidfd_open(process.pid)
        except OSError:
            pass  # old kernel or a seccomp policy: use the pipe
        else:
            return fd, _closer(fd)
    read_end, write_end = os.pipe()

    def close_when_exited() -> None:
        try:
            process.wait()
        finally:
            os.close(write_end)

    threading.Thread(
        target=close_when_exited, name=f"{PROCESS_NAME}-sentinel", daemon=True
    ).start()
    return read_end, _closer(read_end)


def _closer(fd: int) -> Callable[[], None]:
    state = {"open": True}

    def close() -> None:
        if state["open"]:
            state["open"] = False
            with contextlib.suppress(OSError):
                os.close(fd)

    return close


class CoordinatorProcess:
    """The coordinator child with the attributes of a `multiprocessing.Process` vLLM reads.

    `pid`, `name`, `sentinel`, `exitcode` (negative signal number when killed by
    a signal, as multiprocessing reports it) and `is_alive()`, plus `join`,
    `terminate` and `kill` for code that manages processes generically.
    """

    def __init__(
        self,
        process: subprocess.Popen[bytes],
        *,
        name: str = PROCESS_NAME,
        prefer_pidfd: bool = True,
    ) -> None:
        self._process = process
        self.name = name
        self.pid: int = process.pid
        self.daemon = True
        self._sentinel, close = open_exit_sentinel(process, prefer_pidfd=prefer_pidfd)
        # The sentinel may sit in a caller's poller after shutdown, so it stays
        # open (and readable) for as long as this object lives.
        self._close_sentinel = weakref.finalize(self, close)

    @property
    def sentinel(self) -> int:
        return self._sentinel

    @property
    def exitcode(self) -> int | None:
        return self._process.poll()

    def is_alive(self) -> bool:
        return self._process.poll() is None

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(timeout)

    def terminate(self) -> None:
        if self.is_alive():
            self._process.terminate()

    def kill(self) -> None:
        if self.is_alive():
            self._process.kill()

    def close(self) -> None:
        """Release the sentinel; only once nobody waits on it any more."""
        self._close_sentinel()

    def __repr__(self) -> str:
        code = self.exitcode
        state = "alive" if code is None else f"exitcode={code}"
        return f"<CoordinatorProcess name={self.name!r} pid={self.pid} {state}>"


# ---- log forwarding ---------------------------------------------------------------------


def write_to_stderr(line: str) -> None:
    """Default log sink: the parent's stderr, where vLLM's own children log."""
    with contextlib.suppress(Exception):  # a closed stderr at interpreter exit
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


class _LogForwarder:
    """Follows the child's stderr file and hands each line, prefixed, to a sink.

    vLLM's own coordinator is a forked child writing to the parent's stderr;
    ours writes to a file (`launch` needs it to report start-up failures), so
    its lines are copied out to keep a refusal's reason in the operator's log.
    """

    def __init__(
        self,
        path: str,
        *,
        prefix: str,
        sink: Callable[[str], None],
        exited: Callable[[], bool],
        poll_s: float = 0.1,
    ) -> None:
        self._file: BinaryIO = open(path, "rb")  # noqa: SIM115  # closed by the thread
        self._prefix = prefix
        self._sink = sink
        self._exited = exited
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{PROCESS_NAME}-log",
                                        daemon=True)
        self._thread.start()

    def _emit(self, raw: bytes) -> None:
        with contextlib.suppress(Exception):  # a broken sink must not end the forwarding
            self._sink(self._prefix + raw.decode(errors="replace").rstrip("\r"))

    def _run(self) -> None:
        pending = b""
        last_look = False
        try:
            while True:
                chunk = self._file.read(65536)
                if chunk:
                    pending += chunk
                    *lines, pending = pending.split(b"\n")
                    for line in lines:
                        self._emit(line)
                    continue
                if last_look:
                    break
                if self._stop.is_set() or self._exited():
                    last_look = True  # read once more: the child may have written since
                    continue
                self._stop.wait(self._poll_s)
            if pending:
                self._emit(pending)
        finally:
            self._file.close()

    def stop(self, timeout: float = 1.0) -> None:
        self._stop.set()
        self._thread.join(timeout)


# ---- the drop-in ------------------------------------------------------------------------


def _serve_accepts(flag: str) -> bool:
    """Whether `dp-coordinator serve` knows `flag` (flags appear as the server grows)."""
    return flag in serve_option_names()


DROPIN_FLAGS: Final = (*LAUNCHER_FLAGS, "--ipc-dir")
"""`serve` flags the drop-in sets from vLLM's settings; extra flags may not repeat them."""


def _refuse_dropin_flags(args: Sequence[str], source: str) -> None:
    unknown = unknown_flags(args)
    if unknown:
        raise LauncherFlagError(
            f"{source} has {', '.join(unknown)}, which `dp-coordinator serve` does not know "
            f"(or cannot tell from another flag it abbreviates); `dp-coordinator serve "
            f"--help` lists its flags")
    found = find_flags(args, DROPIN_FLAGS)
    if found:
        raise LauncherFlagError(
            f"{source} sets {describe_flags(found)}, which the drop-in sets itself from "
            f"vLLM's settings (ranks from data_parallel_size, the transport from vLLM's "
            f"rule, ipc under VLLM_RPC_BASE_PATH, waves from enable_wave_coordination, "
            f"its own address file); remove {'it' if len(found) == 1 else 'them'}"
        )


def _default_log_level() -> str:
    """Follow vLLM's VLLM_LOGGING_LEVEL (default INFO)."""
    return _LOG_LEVELS.get(os.environ.get("VLLM_LOGGING_LEVEL", "INFO").strip().lower(), "info")


def _stop_coordinator(
    handle: CoordinatorHandle,
    forwarder: _LogForwarder | None,
    owned_ipc_dir: str | None,
    timeout: float | None,
    owner_pid: int,
    published: PublishedAddresses | None = None,
) -> None:
    if os.getpid() != owner_pid:
        # A forked copy of the owner (vLLM forks API servers and engines) must not
        # stop the coordinator or delete its sockets when the copy exits.
        return
    try:
        if published is not None:
            published.remove()  # first: a stopping coordinator is not to be found
        handle.shutdown(timeout=timeout)
    finally:
        if forwarder is not None:
            forwarder.stop(timeout=1.0)
        if owned_ipc_dir is not None:
            shutil.rmtree(owned_ipc_dir, ignore_errors=True)


class DPCoordinatorProcess:
    """A dp-coordinator process behind vLLM 0.33's `DPCoordinator` interface.

    Build it the way vLLM's launcher does::

        coord = DPCoordinatorProcess(parallel_config, enable_wave_coordination=True)

    or with keywords only (each keyword overrides the object's attribute)::

        coord = DPCoordinatorProcess(data_parallel_size=4, data_parallel_master_ip="10.0.0.1",
                                     data_parallel_size_local=2)

    The constructor returns once every socket is bound (or raises RuntimeError,
    as vLLM's does, when the process fails or takes longer than
    `startup_timeout`). `logging_config` is accepted for signature
    compatibility and not used; the child's log level follows
    `VLLM_LOGGING_LEVEL` unless `log_level` is given, and its log lines are
    copied to `log_sink` (the parent's stderr by default; None to stop that).
    Flags in the environment variable `DP_COORDINATOR_SERVE_ARGS` and
    `extra_args` are passed on to `dp-coordinator serve` (`--log-level` there
    wins); the flags of `DROPIN_FLAGS`, which the drop-in sets itself, are
    refused at once with a `ValueError` naming them.

    Once up, the addresses are published for discovery (`discovery_file`, None
    if that failed): ``dp-coordinator-<data_parallel_master_port>.json`` under
    vLLM's RPC base path, or ``dp-coordinator-<master port>-<pid>.json`` when a
    live coordinator already holds that name (``pid<pid>`` without a master port).
    """

    def __init__(
        self,
        parallel_config: object | None = None,
        enable_wave_coordination: bool = True,
        logging_config: object | None = None,
        *,
        data_parallel_size: int | None = None,
        data_parallel_master_ip: str | None = None,
        data_parallel_size_local: int | None = None,
        local_engines_only: bool | None = None,
        data_parallel_external_lb: bool | None = None,
        data_parallel_hybrid_lb: bool | None = None,
        enable_elastic_ep: bool | None = None,
        data_parallel_master_port: int | None = None,
        vllm_compat: str = "0.33",
        ipc_dir: str | None = None,
        extra_args: Sequence[str] = (),
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT_S,
        log_level: str | None = None,
        log_sink: Callable[[str], None] | None = write_to_stderr,
        prefer_pidfd: bool = True,
    ) -> None:
        self.settings = resolve_parallel_settings(
            parallel_config,
            data_parallel_size=data_parallel_size,
            data_parallel_master_ip=data_parallel_master_ip,
            data_parallel_size_local=data_parallel_size_local,
            local_engines_only=local_engines_only,
            data_parallel_external_lb=data_parallel_external_lb,
            data_parallel_hybrid_lb=data_parallel_hybrid_lb,
            enable_elastic_ep=enable_elastic_ep,
            data_parallel_master_port=data_parallel_master_port,
        )
        self.plan = plan_transports(self.settings)
        self.enable_wave_coordination = bool(enable_wave_coordination)
        self._coord_store: object | None = None

        # Refused before anything is made: a repeated flag would send the child's
        # address file elsewhere (start-up waits for nothing) or contradict vLLM.
        env_args = shlex.split(os.environ.get(EXTRA_ARGS_ENV, ""))
        _refuse_dropin_flags(env_args, EXTRA_ARGS_ENV)
        _refuse_dropin_flags(extra_args, "extra_args")

        host = self.plan.bind_host
        args = ["--vllm-compat", vllm_compat]
        owned_ipc_dir: str | None = None
        if host is None:
            if ipc_dir is None:
                # Under vLLM's ipc base path when set. The directory is ours, so it
                # goes at shutdown even if the child could not clean up (killed).
                owned_ipc_dir = tempfile.mkdtemp(
                    prefix="dpc-", dir=os.environ.get("VLLM_RPC_BASE_PATH") or None
                )
                ipc_dir = owned_ipc_dir
            args += ["--ipc-dir", ipc_dir]
        if self.settings.enable_elastic_ep:
            # vLLM's frontends resize the group with SCALE_ELASTIC_EP, within the bound
            # vLLM itself enforces; by default the coordinator's size is fixed.
            size = self.settings.data_parallel_size
            most = self.settings.elastic_ep_max_dp_size
            args += ["--min-engines", "1", "--max-engines",
                     str(most if isinstance(most, int) and most >= size else size)]
        args += env_args
        args += list(extra_args)
        if host is not None and self._needs_insecure(host, args):
            # Stock vLLM engines and API servers cannot do CURVE, and vLLM's own
            # coordinator binds the same address without authentication.
            args.append("--insecure")

        try:
            handle = launch(
                engines=self.settings.data_parallel_size,
                host=host,
                lockstep=self.enable_wave_coordination,
                extra_args=args,
                timeout=startup_timeout,
                log_level=log_level or _default_log_level(),
            )
        except BaseException:
            if owned_ipc_dir is not None:
                shutil.rmtree(owned_ipc_dir, ignore_errors=True)
            raise
        self._handle = handle
        self.addresses: dict[str, str] = dict(handle.addresses)
        # vLLM starts its API servers after the coordinator and they inherit this: with
        # DP_COORDINATOR_ROUTE=1 they ask for ranks there (coordinator.vllm_plugin).
        os.environ[ROUTE_ADDRESS_ENV] = self.addresses["frontend"]
        forwarder: _LogForwarder | None = None
        try:
            self.proc = CoordinatorProcess(handle.process, prefer_pidfd=prefer_pidfd)
            if log_sink is not None:
                forwarder = _LogForwarder(
                    handle._stderr_path,
                    prefix=f"({PROCESS_NAME} pid={handle.pid}) ",
                    sink=log_sink,
                    exited=lambda: handle.process.poll() is not None,
                )
        except BaseException:
            _stop_coordinator(handle, forwarder, owned_ipc_dir, 2.0, os.getpid())
            raise
        port = self.settings.data_parallel_master_port
        published = publish_addresses(
            self.addresses, str(port) if port is not None else f"pid{handle.pid}",
            fallback=str(handle.pid))
        self.discovery_file: str | None = published.path if published is not None else None
        self._published = published
        self._forwarder = forwarder
        self._owned_ipc_dir = owned_ipc_dir
        self._owner_pid = os.getpid()
        # Like vLLM's: the process goes when this object does, or at interpreter exit.
        self._finalizer = weakref.finalize(
            self, _stop_coordinator, handle, forwarder, owned_ipc_dir, 5.0, self._owner_pid,
            published,
        )

    @staticmethod
    def _needs_insecure(host: str, args: Sequence[str]) -> bool:
        if is_loopback_host(host.strip("[]")):
            return False
        if "--insecure" in args or any(a.startswith("--curve-secret-key") for a in args):
            return False
        return _serve_accepts("--insecure")

    # -- vLLM's DPCoordinator interface --

    def get_stats_publish_address(self) -> str:
        """Where API servers subscribe for `[counts, wave, running]` (front_publish)."""
        return self.addresses["front_publish"]

    def get_engine_socket_addresses(self) -> tuple[str, str]:
        """`(coordinator_input, coordinator_output)` for engines: back_publish, back_output."""
        return self.addresses["back_publish"], self.addresses["back_output"]

    def shutdown(self, timeout: float | None = 5.0) -> None:
        """SIGTERM, wait up to `timeout` (None: 5 s), then SIGKILL. Idempotent.

        Never raises, as vLLM's `shutdown` calls it in a `finally`. However
        small `timeout` is (vLLM passes 0 by default), the process gets
        `coordinator.launch.SIGTERM_GRACE_S` to exit cleanly before SIGKILL;
        either way its files are gone when this returns. Only the process that
        started the coordinator stops it; in a forked copy this does nothing.
        """
        if self._finalizer.detach() is not None:
            _stop_coordinator(self._handle, self._forwarder, self._owned_ipc_dir,
                              timeout, self._owner_pid, self._published)

    # -- extras --

    def stderr_text(self) -> str:
        """The child's log so far; after shutdown, its last 64 KiB."""
        return self._handle.stderr_text()

    def __repr__(self) -> str:
        return (
            f"<DPCoordinatorProcess dp_size={self.settings.data_parallel_size} "
            f"front={self.plan.front_publish} back={self.plan.back} "
            f"lockstep={self.enable_wave_coordination} proc={self.proc!r}>"
        )
