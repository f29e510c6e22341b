"""A coordinator, its frontend and a DP group spread over sandbox hosts.

    cluster = Cluster.start(sandbox, workdir, layout=Layout(...))
    cluster.driver.call("load", rate=20, steps=60, prefix="warm")
    cluster.sandbox.partition("hostb")
    ...
    cluster.stop()

Processes, each started inside its host's namespace:

* on the coordinator's host, the frontend driver (`tests.netns.frontend_driver`),
  which starts `python -m coordinator serve` beside itself with
  `coordinator.launch`, on tcp at that host's address (`--insecure`: a
  non-loopback bind without CURVE keys);
* on every engine host, one `python -m coordinator.sim engine` per rank. The
  ranks form one lockstep DP group whose per-step collective hub lives in the
  first rank's process (like the torch store of rank 0), so ranks on different
  hosts meet over the sandbox network just as MoE ranks do.

Every wait is bounded; `stop()` asks each process to exit, and the sandbox kills
whatever is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.netns.sandbox import Sandbox

REPO = str(Path(__file__).resolve().parents[2])
COLLECTIVE_PORT = 29500
METRICS_PORT = 9464


class DriverError(RuntimeError):
    """The frontend driver did not answer, or answered with an error."""


class DriverClient:
    """Talks to the frontend driver over its stdin/stdout (one JSON object per line)."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        if process.stdin is None or process.stdout is None:
            raise ValueError("the driver needs stdin and stdout pipes")
        self.process = process
        self._stdin = process.stdin
        self._fd = process.stdout.fileno()
        os.set_blocking(self._fd, False)
        self._buffer = b""
        self._next_id = 0

    def read_line(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DriverError(f"no line from the frontend driver within {timeout:g} s")
            ready, _, _ = select.select([self._fd], [], [], remaining)
            if not ready:
                continue
            chunk = os.read(self._fd, 1 << 20)
            if not chunk:
                raise DriverError(f"the frontend driver exited (code {self.process.poll()})")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        message: dict[str, Any] = json.loads(line)
        return message

    def call(self, op: str, *, timeout: float = 10.0, **arguments: Any) -> dict[str, Any]:
        """Send one command and wait (at most `timeout`) for its reply."""
        self._next_id += 1
        call_id = self._next_id
        self._stdin.write(json.dumps({"op": op, "id": call_id, **arguments}).encode() + b"\n")
        self._stdin.flush()
        deadline = time.monotonic() + timeout
        while True:
            message = self.read_line(max(0.0, deadline - time.monotonic()))
            if message.get("id") == call_id:
                if not message.get("ok"):
                    raise DriverError(f"{op}: {message.get('error')}")
                return message


@dataclass
class Layout:
    """Where things run: the coordinator's host, and the ranks on each engine host."""

    coordinator_host: str
    ranks: Mapping[str, Sequence[int]]
    lease_ttl_s: float = 3.0
    step_ms: float = 10.0
    engine_heartbeat_s: float = 0.5
    #: Long enough to outlast any partition here, short enough to end a stuck run.
    collective_timeout_s: float = 60.0

    @property
    def engines(self) -> int:
        return sum(len(r) for r in self.ranks.values())

    def host_of(self, rank: int) -> str:
        for host, ranks in self.ranks.items():
            if rank in ranks:
                return host
        raise KeyError(rank)


@dataclass
class Cluster:
    sandbox: Sandbox
    workdir: Path
    layout: Layout
    driver: DriverClient
    driver_process: subprocess.Popen[bytes]
    coordinator_pid: int
    addresses: dict[str, str]
    engines: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    @classmethod
    def start(cls, sandbox: Sandbox, workdir: Path, layout: Layout,
              *, timeout: float = 45.0) -> Cluster:
        deadline = time.monotonic() + timeout
        addr_file = workdir / "coordinator.json"
        coord_host = layout.coordinator_host
        serve_args = ["--insecure", "--lease-ttl-s", str(layout.lease_ttl_s)]
        process = sandbox.popen(
            coord_host,
            [sys.executable, "-m", "tests.netns.frontend_driver",
             "--addr-file", str(addr_file), "--host", sandbox.address(coord_host),
             "--engines", str(layout.engines), "--metrics-port", str(METRICS_PORT),
             "--", *serve_args],
            stdout=subprocess.PIPE, stderr=str(workdir / "driver.log"),
            stdin=subprocess.PIPE, cwd=REPO,
        )
        driver = DriverClient(process)
        engines = cls._start_engines(sandbox, workdir, layout, addr_file)
        hello = driver.read_line(max(1.0, deadline - time.monotonic()))
        if hello.get("event") != "registered":
            raise DriverError(f"unexpected first line from the driver: {hello}")
        cluster = cls(sandbox, workdir, layout, driver, process, int(hello["coordinator_pid"]),
                      dict(hello["addresses"]), engines)
        remaining = max(1.0, deadline - time.monotonic())
        driver.call("wait_ready", timeout=remaining + 2.0, within=remaining)
        return cluster

    @staticmethod
    def _start_engines(sandbox: Sandbox, workdir: Path, layout: Layout,
                       addr_file: Path) -> dict[int, subprocess.Popen[bytes]]:
        first = min(rank for ranks in layout.ranks.values() for rank in ranks)
        hub_host = layout.host_of(first)
        collective = f"tcp://{sandbox.address(hub_host)}:{COLLECTIVE_PORT}"
        engines = {}
        for host, ranks in layout.ranks.items():
            for rank in ranks:
                args = [
                    sys.executable, "-m", "coordinator.sim", "engine",
                    "--rank", str(rank), "--engines", str(layout.engines),
                    "--addr-file", str(addr_file), "--collective", collective,
                    "--step-ms", str(layout.step_ms), "--on-hang", "fail",
                    "--collective-timeout", str(layout.collective_timeout_s),
                    "--heartbeat", str(layout.engine_heartbeat_s),
                    "--ready-timeout", "60", "--wait-addr-file", "40",
                ]
                if rank == first:
                    args.append("--host-collective")
                engines[rank] = sandbox.popen(
                    host, args, cwd=REPO,
                    stdout=str(workdir / f"engine{rank}.out"),
                    stderr=str(workdir / f"engine{rank}.log"),
                )
        return engines

    # ---- observation ----------------------------------------------------------

    def ledger(self) -> dict[str, Any]:
        return self.driver.call("ledger", timeout=10.0)

    def http_state(self) -> dict[str, Any]:
        answer = self.driver.call("http", path="/state", timeout=5.0)
        state: dict[str, Any] = answer["json"]
        return state

    def status_cli(self) -> dict[str, Any]:
        """`dp-coordinator status --json`, run on the coordinator's host."""
        result = self.sandbox.run(
            self.layout.coordinator_host,
            [sys.executable, "-m", "coordinator", "status", "--addr-file",
             str(self.workdir / "coordinator.json"), "--json", "--timeout", "5"],
            timeout=20.0, cwd=REPO,
        )
        if result.returncode != 0:
            raise DriverError(f"dp-coordinator status exited {result.returncode}: "
                              f"{result.stderr.strip()}")
        status: dict[str, Any] = json.loads(result.stdout)
        return status

    def engines_alive(self) -> dict[int, bool]:
        return {rank: process.poll() is None for rank, process in self.engines.items()}

    def logs_tail(self, chars: int = 3000) -> str:
        """The end of every process log, for failure messages."""
        parts = []
        paths = sorted(self.workdir.glob("*.log")) + sorted(self.workdir.glob("*.stderr"))
        for path in paths:
            with contextlib.suppress(OSError):
                parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-chars:]}")
        return "\n".join(parts)

    # ---- teardown -------------------------------------------------------------

    def stop(self) -> dict[str, Any]:
        """Stop the driver (and with it the coordinator), then the engines; exit codes."""
        result: dict[str, Any] = {}
        with contextlib.suppress(DriverError, OSError, ValueError):
            result["coordinator_exit"] = self.driver.call("quit", timeout=15.0)[
                "coordinator_exit"]
        for process in [self.driver_process, *self.engines.values()]:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10.0
        for rank, process in self.engines.items():
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(max(0.1, deadline - time.monotonic()))
            result[f"engine{rank}_exit"] = process.poll()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.driver_process.wait(max(0.1, deadline - time.monotonic()))
        return result
