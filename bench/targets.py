"""The processes under test: our coordinator (uvloop or plain asyncio), the floor, a peer.

Each target is its own process, started fresh for a scenario and told the
number of engines; it writes an address file that the drivers read. A peer is
any command line with `{addr_file}` and `{engines}` in it that writes at least
`back_output`, `back_publish` and `front_publish` (vLLM's three coordinator
sockets), so vLLM's own coordinator can be plugged in behind a small wrapper.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from coordinator._zmq import die_with_parent_preexec

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEER_KEYS = ("back_output", "back_publish", "front_publish")
ALL_KEYS = ("handshake", "dispatch", "back_output", "back_publish", "front_publish", "frontend")

# Our coordinator is started with these on top of the scenario's needs: bench
# engines send no traffic for seconds at a time (a dispatch-only run) and must
# not lose their leases; INFO logs would time the log handler, not the loop.
OURS_BASE_ARGS = ("--lease-ttl-s", "3600", "--log-level", "warning")


class TargetError(RuntimeError):
    """A target process did not come up."""


@dataclass(frozen=True)
class TargetSpec:
    """How to start one kind of target; `name` is what reports call it."""

    name: str
    kind: str  # "ours", "floor" or "peer"
    loop: str = "uvloop"  # ours only: "uvloop" or "asyncio"
    command: str = ""  # peer only
    args: tuple[str, ...] = ()  # floor only: extra command-line arguments

    @property
    def label(self) -> str:
        return self.name


OURS = TargetSpec("ours", "ours")
OURS_ASYNCIO = TargetSpec("ours-asyncio", "ours", loop="asyncio")
FLOOR = TargetSpec("floor", "floor")
# The floor taking its input in 1 ms batches: what a coordinator that coalesces
# its reads could get down to in CPU, at up to 1 ms more latency.
FLOOR_BATCHED = TargetSpec("floor-batched", "floor", args=("--coalesce-ms", "1"))


def peer_spec(command: str) -> TargetSpec:
    return TargetSpec("peer", "peer", command=command)


_loop_flag_supported: bool | None = None


def serve_supports_loop_flag() -> bool:
    """True if `dp-coordinator serve` has `--loop` (checked once via --help)."""
    global _loop_flag_supported
    if _loop_flag_supported is None:
        try:
            out = subprocess.run(
                [sys.executable, "-m", "coordinator", "serve", "--help"],
                capture_output=True, text=True, timeout=30, check=False,
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            out = ""
        _loop_flag_supported = "--loop" in out
    return _loop_flag_supported


def ours_command(spec: TargetSpec, engines: int, addr_file: str) -> list[str]:
    serve_args = ["serve", "--engines", str(engines), "--addr-file", addr_file,
                  *OURS_BASE_ARGS, *shlex.split(os.environ.get("BENCH_OURS_EXTRA_ARGS", ""))]
    if spec.loop == "asyncio":
        if serve_supports_loop_flag():
            return [sys.executable, "-m", "coordinator", *serve_args, "--loop", "asyncio"]
        # No server flag: run the same CLI with uvloop switched off from outside.
        return [sys.executable, "-m", "bench.asyncio_serve", *serve_args]
    return [sys.executable, "-m", "coordinator", *serve_args]


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of `pid` in seconds (/proc/<pid>/stat fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as handle:
        # The command name (field 2) may hold spaces; the fields after it do not.
        fields = handle.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def threads_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds of `pid` split into libzmq's background threads and the rest.

    libzmq names its I/O and reaper threads `ZMQbg/...`; what remains is the
    interpreter (the event loop and anything it started).
    """
    out = {"zmq_threads": 0.0, "python_threads": 0.0}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/task/{tid}/stat") as handle:
                head, _, rest = handle.read().rpartition(")")
            fields = rest.split()
            seconds = (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
            key = "zmq_threads" if "ZMQbg" in head else "python_threads"
            out[key] += seconds
    return out


def _child_setup(die_with_parent: Callable[[], None] | None, nofile_soft: int | None) -> None:
    if die_with_parent is not None:
        die_with_parent()
    if nofile_soft is not None:
        import resource

        _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(nofile_soft, hard), hard))


@dataclass
class RunningTarget:
    spec: TargetSpec
    engines: int
    process: subprocess.Popen[bytes]
    addresses: dict[str, str]
    workdir: str
    stderr_path: str
    group: bool = False
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def stderr_tail(self, limit: int = 4000) -> str:
        with contextlib.suppress(OSError), open(self.stderr_path, errors="replace") as handle:
            return handle.read()[-limit:]
        return ""

    def rss_kib(self) -> dict[str, int]:
        """VmRSS and VmHWM of the target process, from /proc."""
        values: dict[str, int] = {}
        with open(f"/proc/{self.pid}/status") as handle:
            for line in handle:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    values[key] = int(rest.split()[0])
        return values

    def cpu_seconds(self) -> float:
        """User + system CPU time of the target process (all its threads), from /proc."""
        return process_cpu_seconds(self.pid)

    def threads_cpu_seconds(self) -> dict[str, float]:
        return threads_cpu_seconds(self.pid)

    def fd_count(self) -> int:
        """Open file descriptors of the target process, from /proc."""
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def stop(self, timeout: float = 5.0) -> None:
        if self.process.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.process.wait(timeout)
        if self.group:
            # The shell that led the group may be gone while what it started is not.
            deadline = time.monotonic() + timeout
            while self._group_alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            if self._group_alive():
                self._signal(signal.SIGKILL)
        import shutil

        shutil.rmtree(self.workdir, ignore_errors=True)

    def _group_alive(self) -> bool:
        """True while a process of the target's group still runs (zombies aside)."""
        pgid = str(self.process.pid)
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            with contextlib.suppress(OSError):
                with open(f"/proc/{entry}/stat") as handle:
                    fields = handle.read().rpartition(")")[2].split()
                if fields[2] == pgid and fields[0] != "Z":
                    return True
        return False

    def _signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            if self.group:
                os.killpg(self.process.pid, signum)
            else:
                self.process.send_signal(signum)


def start_target(spec: TargetSpec, *, engines: int, mode: str, timeout: float = 60.0,
                 extra_args: Sequence[str] = (), nofile_soft: int | None = None
                 ) -> RunningTarget:
    """Start `spec` for `engines` engines and wait for its address file.

    `extra_args` go to our coordinator's command line (e.g. `--host 127.0.0.1`
    for tcp); `nofile_soft` sets the target's soft RLIMIT_NOFILE, to see how
    it fares under a limit other than the harness's raised one.
    """
    workdir = tempfile.mkdtemp(prefix=f"bench-{spec.name}-")
    addr_file = os.path.join(workdir, "addresses.json")
    stderr_path = os.path.join(workdir, "stderr.log")
    group = False
    if spec.kind == "ours":
        argv: list[str] | str = [*ours_command(spec, engines, addr_file), *extra_args]
        keys = ALL_KEYS
    elif spec.kind == "floor":
        argv = [sys.executable, "-m", "bench.floor", "--mode", mode, "--engines", str(engines),
                "--addr-file", addr_file, *spec.args]
        keys = ALL_KEYS
    elif spec.kind == "peer":
        argv = spec.command.replace("{addr_file}", shlex.quote(addr_file)).replace(
            "{engines}", str(engines))
        keys = PEER_KEYS
        group = True
    else:
        raise ValueError(f"unknown target kind {spec.kind!r}")
    env = os.environ.copy()
    # `python -m bench.floor` must find this package wherever the bench was started.
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (REPO_ROOT, env.get("PYTHONPATH", "")) if p)
    with open(stderr_path, "wb") as stderr:
        process = subprocess.Popen(
            argv, shell=isinstance(argv, str), stdin=subprocess.DEVNULL,
            # A peer may log to stdout (vLLM does): keep it with stderr for the tail.
            stdout=stderr if spec.kind == "peer" else subprocess.DEVNULL, stderr=stderr,
            start_new_session=group, env=env,
            preexec_fn=functools.partial(_child_setup, die_with_parent_preexec(), nofile_soft),
        )
    target = RunningTarget(spec, engines, process, {}, workdir, stderr_path, group)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = target.stderr_tail()
            target.stop()
            raise TargetError(f"{spec.name} exited with {process.returncode} at start-up:\n{tail}")
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
            with open(addr_file) as handle:
                addresses = json.load(handle)
            if all(key in addresses for key in keys):
                target.addresses = {str(k): str(v) for k, v in addresses.items()}
                return target
        time.sleep(0.02)
    tail = target.stderr_tail()
    target.stop()
    raise TargetError(f"{spec.name} wrote no address file within {timeout} s:\n{tail}")
