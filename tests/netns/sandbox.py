"""Network namespaces joined by a switch: hosts of their own for multi-host tests.

    sandbox = Sandbox.create(["coord", "hosta", "hostb"])
    sandbox.address("coord")                      # "10.213.0.1"
    proc = sandbox.popen("hosta", [sys.executable, "-m", ...], log_prefix=...)
    sandbox.partition("hostb")                    # hostb's traffic vanishes
    sandbox.heal("hostb")
    sandbox.destroy()                             # every process, link and namespace

Layout: one *switch* namespace holds a bridge; each host is a namespace with
`lo` and an `eth0` whose veth peer is a port of that bridge, on the private
subnet 10.213.0.0/24 (host i gets .i+1). Nothing is created in the namespace the
tests run in, so the sandbox cannot collide with the machine's own network, and
deleting the namespaces removes every link with them.

Partitions detach the host's port from the bridge. Both ends keep their carrier
and addresses; frames from and to the host are simply no longer forwarded, as
when a switch or cable in the middle fails. Taking the host's own link down
would instead hand its kernel a carrier loss and make its connects fail at once
with "no route", which a remote failure never does. (tc and iptables drops would
be equivalent, but need kernel modules and tools a test machine may lack.)

Every host namespace caps the TCP retransmission back-off (`tcp_rto_max_ms`,
where the kernel has it) at one second, so that traffic resumes within about a
second of a heal instead of after the doubling back-off of a long partition (up
to 120 s by default). Connections behave the same either way; only the wait
after a heal is shorter.

Names carry the pid of the process that made them (`dpcn<pid>-<host>`). A run
that was killed leaves its namespaces behind; `sweep_stale()` (called by
`create`) kills the processes left in namespaces whose owner is gone and
deletes them.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

PREFIX = "dpcn"
SUBNET = "10.213.0"
SWITCH = "switch"
_NAME = re.compile(rf"^{PREFIX}(\d+)-[a-z0-9]+$")
# tcp_rto_max_ms is the ceiling of the retransmission timer (Linux 6.15 and later).
_RTO_MAX_SYSCTL = "net.ipv4.tcp_rto_max_ms"
_RTO_MAX_MS = 1000
_IP_TIMEOUT_S = 10.0


class SandboxError(RuntimeError):
    """An `ip` command failed while building or changing the sandbox."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT_S, check=False
    )
    if check and result.returncode != 0:
        raise SandboxError(f"ip {' '.join(args)} failed ({result.returncode}): "
                           f"{result.stderr.strip()}")
    return result


def list_namespaces() -> list[str]:
    result = _ip("netns", "list", check=False)
    # Lines look like "name" or "name (id: 3)".
    return [line.split()[0] for line in result.stdout.splitlines() if line.strip()]


def namespace_pids(namespace: str) -> list[int]:
    result = _ip("netns", "pids", namespace, check=False)
    return [int(word) for word in result.stdout.split() if word.isdigit()]


def _owner_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_all_in(namespace: str) -> None:
    """SIGKILL every process still inside `namespace` (all started there by us)."""
    for _ in range(3):
        pids = namespace_pids(namespace)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def sweep_stale() -> list[str]:
    """Remove namespaces left by runs whose process is gone; returns their names."""
    removed = []
    for name in list_namespaces():
        match = _NAME.match(name)
        if match is None:
            continue
        owner = int(match.group(1))
        if owner == os.getpid() or _owner_alive(owner):
            continue
        _kill_all_in(name)
        _ip("netns", "del", name, check=False)
        removed.append(name)
    return removed


def probe() -> str | None:
    """None if this machine lets us build a sandbox, else why not (a skip reason)."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.name != "posix" or not os.path.isdir("/proc/self/ns"):
        return "network namespaces need Linux"
    tag = f"{PREFIX}{os.getpid()}-probe"
    peer = f"{PREFIX}{os.getpid()}-probep"
    try:
        added = _ip("netns", "add", tag, check=False)
        if added.returncode != 0:
            why = added.stderr.strip() or f"exit code {added.returncode}"
            hint = "" if os.geteuid() == 0 else " (not running as root)"
            return f"`ip netns add` failed{hint}: {why}"
        steps = [
            ("netns", "add", peer),
            ("-n", tag, "link", "add", "br0", "type", "bridge"),
            ("link", "add", "name", "eth0", "netns", peer, "type", "veth",
             "peer", "name", "port0", "netns", tag),
            ("-n", tag, "link", "set", "dev", "port0", "master", "br0"),
        ]
        for step in steps:
            result = _ip(*step, check=False)
            if result.returncode != 0:
                return (f"`ip {' '.join(step)}` failed (no CAP_NET_ADMIN, or no veth/bridge "
                        f"support?): {result.stderr.strip()}")
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        return f"could not run `ip`: {exc}"
    finally:
        for name in (tag, peer):
            _ip("netns", "del", name, check=False)


def _die_with_parent() -> None:
    """Linux: SIGKILL the child if the test process dies without cleaning up."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class Sandbox:
    """Host namespaces on one switch; see the module docstring."""

    hosts: list[str]
    tag: str
    rto_capped: bool = False
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    partitioned: set[str] = field(default_factory=set)
    _created: list[str] = field(default_factory=list)

    @classmethod
    def create(cls, hosts: Sequence[str]) -> Sandbox:
        """Build the switch and the hosts; on any failure, remove what was built."""
        if len(hosts) > 250 or len(set(hosts)) != len(hosts):
            raise ValueError("need at most 250 distinct host names")
        for host in hosts:
            if not re.fullmatch(r"[a-z][a-z0-9]{0,9}", host) or host == SWITCH:
                raise ValueError(f"host names are short lowercase words, got {host!r}")
        sweep_stale()
        sandbox = cls(list(hosts), f"{PREFIX}{os.getpid()}")
        try:
            sandbox._build()
        except BaseException:
            sandbox.destroy()
            raise
        return sandbox

    def namespace(self, host: str) -> str:
        if host != SWITCH and host not in self.hosts:
            raise KeyError(f"no host {host!r} in this sandbox (hosts: {self.hosts})")
        return f"{self.tag}-{host}"

    def address(self, host: str) -> str:
        return f"{SUBNET}.{self.hosts.index(host) + 1}"

    def _port(self, host: str) -> str:
        return f"p{self.hosts.index(host)}"

    def _add_namespace(self, host: str) -> str:
        name = self.namespace(host)
        _ip("netns", "del", name, check=False)  # a leftover of ours with a reused pid
        _ip("netns", "add", name)
        self._created.append(name)
        _ip("-n", name, "link", "set", "dev", "lo", "up")
        return name

    def _build(self) -> None:
        switch = self._add_namespace(SWITCH)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "dev", "br0", "up")
        capped = []
        for host in self.hosts:
            name = self._add_namespace(host)
            port = self._port(host)
            # Both ends are created inside their namespaces: no name is ever taken
            # in the namespace the tests run in.
            _ip("link", "add", "name", "eth0", "netns", name, "type", "veth",
                "peer", "name", port, "netns", switch)
            _ip("-n", switch, "link", "set", "dev", port, "master", "br0")
            _ip("-n", switch, "link", "set", "dev", port, "up")
            _ip("-n", name, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "dev", "eth0", "up")
            capped.append(self._cap_rto(name))
        self.rto_capped = all(capped)

    @staticmethod
    def _cap_rto(namespace: str) -> bool:
        result = subprocess.run(
            ["ip", "netns", "exec", namespace, "sysctl", "-q", "-w",
             f"{_RTO_MAX_SYSCTL}={_RTO_MAX_MS}"],
            capture_output=True, text=True, timeout=_IP_TIMEOUT_S, check=False,
        )
        return result.returncode == 0

    @property
    def heal_delay_bound_s(self) -> float:
        """How long after a heal TCP may wait before retransmitting (kernel back-off)."""
        return _RTO_MAX_MS / 1000 if self.rto_capped else 120.0

    # ---- processes ----------------------------------------------------------

    def popen(
        self,
        host: str,
        args: Sequence[str],
        *,
        stdout: str | int | None = None,
        stderr: str | None = None,
        stdin: int | None = subprocess.DEVNULL,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start `args` inside `host`'s namespace; it is killed in `destroy()`.

        `stdout`/`stderr` are file paths (opened for writing), or for stdout a
        subprocess constant such as PIPE.
        """
        command = ["ip", "netns", "exec", self.namespace(host), *args]
        with contextlib.ExitStack() as files:
            out: int | object | None = stdout
            if isinstance(stdout, str):
                out = files.enter_context(open(stdout, "wb"))
            err: object | None = None
            if stderr is not None:
                err = files.enter_context(open(stderr, "wb"))
            process = subprocess.Popen(
                command, stdin=stdin, stdout=out, stderr=err,  # type: ignore[arg-type]
                cwd=cwd, env=env, start_new_session=True, preexec_fn=_die_with_parent,
            )
        self.processes.append(process)
        return process

    def run(self, host: str, args: Sequence[str], *, timeout: float,
            cwd: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run `args` in `host`'s namespace to completion (bounded by `timeout`)."""
        return subprocess.run(
            ["ip", "netns", "exec", self.namespace(host), *args],
            capture_output=True, text=True, timeout=timeout, cwd=cwd, check=False,
            stdin=subprocess.DEVNULL,
        )

    # ---- faults -------------------------------------------------------------

    def partition(self, host: str) -> float:
        """Stop forwarding `host`'s traffic; returns `time.monotonic()` right after."""
        _ip("-n", self.namespace(SWITCH), "link", "set", "dev", self._port(host), "nomaster")
        self.partitioned.add(host)
        return time.monotonic()

    def heal(self, host: str) -> float:
        """Forward `host`'s traffic again; returns `time.monotonic()` right after."""
        _ip("-n", self.namespace(SWITCH), "link", "set", "dev", self._port(host),
            "master", "br0")
        self.partitioned.discard(host)
        return time.monotonic()

    # ---- teardown -----------------------------------------------------------

    def destroy(self) -> None:
        """Kill every process started here or left inside a host, then delete all."""
        for process in self.processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGKILL)
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(5)
        for name in reversed(self._created):
            _kill_all_in(name)
            _ip("netns", "del", name, check=False)
        self._created.clear()
