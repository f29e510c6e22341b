"""An API frontend process for the multi-host tests, run inside a sandbox host.

    python -m tests.netns.frontend_driver --addr-file F --host 10.213.0.1 --engines 4 \\
        --metrics-port 9464 -- --insecure --lease-ttl-s 3

It does what a frontend beside the coordinator does, through public interfaces
only: starts the coordinator next to itself with `coordinator.launch.launch`
(so both live in this namespace), registers a `coordinator.frontend.
FrontendClient` whose output socket is bound on the host's sandbox address, and
submits simulated requests. It keeps a ledger of every request (submit reply,
finishes, failure notices, each with its `time.monotonic()`: the clock is the
same in every namespace) and of every rank state the coordinator reported
(asked every 100 ms over the frontend socket).

The test drives it with one JSON object per line on stdin and reads one JSON
reply per line on stdout (`{"id": ..., "ok": true, ...}`):

    {"op": "wait_ready", "within": 30}
    {"op": "load", "rate": 20, "steps": 60, "prefix": "warm", "max": 2000}
    {"op": "stop_load"}
    {"op": "submit", "count": 8, "steps": 20, "prefix": "probe"}
    {"op": "ledger"}          every request, rank state sample and transition
    {"op": "transitions"}     only the rank state transitions
    {"op": "settle", "within": 20}   wait until every accepted request ended
    {"op": "state"}           the coordinator's GroupState (frontend socket)
    {"op": "http", "path": "/state"}  the coordinator's HTTP endpoints
    {"op": "quit"}            close the client, stop the coordinator (SIGTERM)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from coordinator.frontend import (
    CoordinatorTimeout,
    EngineDead,
    FinishedRequest,
    FrontendClient,
    FrontendError,
    Notice,
    SubmitError,
    group_state_to_builtins,
)
from coordinator.launch import CoordinatorHandle, launch
from coordinator.protocol import frontend as fp
from coordinator.sim import SimRequest, encode_sim_request

log = logging.getLogger("netns.driver")

STATE_POLL_S = 0.1
MAX_SAMPLES = 3000
SUBMIT_TIMEOUT_S = 5.0


@dataclass
class Record:
    """One request, as this frontend saw it."""

    request_id: str
    steps: int
    submitted_at: float
    replied_at: float | None = None
    rank: int | None = None
    woke: bool = False
    refused: str | None = None
    refused_message: str | None = None
    submit_timed_out: bool = False
    finished: list[tuple[float, int]] = field(default_factory=list)
    """(time, engine_index) of every finished output seen for it."""
    failed: list[tuple[float, int, str]] = field(default_factory=list)
    """(time, rank, reason) of every RequestsFailed naming it."""


class Driver:
    def __init__(self, handle: CoordinatorHandle, client: FrontendClient,
                 metrics_port: int | None) -> None:
        self.coordinator = handle
        self.client = client
        self.metrics_port = metrics_port
        self.records: dict[str, Record] = {}
        self.notices: list[dict[str, Any]] = []
        self.transitions: list[tuple[float, int, str]] = []
        """(time, rank, state) whenever a rank's reported state changed."""
        self.samples: deque[tuple[float, list[tuple[int, str, float | None]]]] = deque(
            maxlen=MAX_SAMPLES)
        """(time, [(rank, state, last_seen_age_s), ...]) from every state query."""
        self.state_query_failures = 0
        self._states: dict[int, str] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._load: asyncio.Task[None] | None = None
        self._load_count = 0

    # ---- callbacks from the SDK ------------------------------------------------

    def on_finished(self, item: FinishedRequest) -> None:
        record = self.records.get(item.request_id)
        if record is None:
            self.notices.append({"kind": "unknown_finish", "at": item.at,
                                 "request_id": item.request_id})
            return
        record.finished.append((item.at, item.engine_index))

    def on_notice(self, notice: Notice) -> None:
        now = time.monotonic()
        if isinstance(notice, fp.RequestsFailed):
            for request_id in notice.request_ids:
                record = self.records.get(request_id)
                if record is not None:
                    record.failed.append((now, notice.rank, notice.reason))
            self.notices.append({"kind": "requests_failed", "at": now, "rank": notice.rank,
                                 "reason": notice.reason, "count": len(notice.request_ids)})
        elif isinstance(notice, EngineDead):
            self.notices.append({"kind": "engine_dead", "at": notice.at})
        else:
            self.notices.append({"kind": type(notice).__name__, "at": now,
                                 "detail": str(notice)})

    # ---- background work -------------------------------------------------------

    async def watch_states(self) -> None:
        while True:
            try:
                state = await self.client.query_state(timeout=1.0)
            except FrontendError:
                self.state_query_failures += 1
            else:
                now = time.monotonic()
                self.samples.append((now, [(e.rank, e.state, e.last_seen_age_s)
                                           for e in state.engines]))
                for engine in state.engines:
                    if self._states.get(engine.rank) != engine.state:
                        self._states[engine.rank] = engine.state
                        self.transitions.append((now, engine.rank, engine.state))
            await asyncio.sleep(STATE_POLL_S)

    def _spawn_submit(self, request_id: str, steps: int) -> asyncio.Task[None]:
        task = asyncio.ensure_future(self.submit_one(request_id, steps))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def submit_one(self, request_id: str, steps: int) -> None:
        record = Record(request_id, steps, time.monotonic())
        self.records[request_id] = record
        payload = encode_sim_request(SimRequest(
            request_id, self.client.client_index, self.client.wave, steps, time.monotonic_ns()))
        try:
            submitted = await self.client.submit(request_id, [payload],
                                                 timeout=SUBMIT_TIMEOUT_S)
        except SubmitError as exc:
            record.refused, record.refused_message = exc.code, exc.message
        except CoordinatorTimeout:
            record.submit_timed_out = True
        except FrontendError as exc:
            record.refused, record.refused_message = type(exc).__name__, str(exc)
        else:
            record.rank, record.woke = submitted.rank, submitted.woke
        record.replied_at = time.monotonic()

    async def run_load(self, rate: float, steps: int, prefix: str, limit: int) -> None:
        interval = 1.0 / rate
        next_at = time.monotonic()
        while self._load_count < limit:
            self._spawn_submit(f"{prefix}-{self._load_count}", steps)
            self._load_count += 1
            next_at += interval
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))

    def open_ids(self) -> list[str]:
        """Accepted (or unanswered) requests with neither a finish nor a failure."""
        return [r.request_id for r in self.records.values()
                if r.refused is None and not r.finished and not r.failed
                and (r.rank is not None or r.submit_timed_out or r.replied_at is None)]

    # ---- commands --------------------------------------------------------------

    async def handle(self, command: dict[str, Any]) -> dict[str, Any]:
        op = command.get("op")
        if op == "wait_ready":
            return await self.wait_ready(float(command.get("within", 30.0)))
        if op == "load":
            if self._load is not None and not self._load.done():
                return {"ok": False, "error": "a load is already running"}
            self._load_count = 0
            self._load = asyncio.ensure_future(self.run_load(
                float(command["rate"]), int(command["steps"]), str(command["prefix"]),
                int(command.get("max", 10_000))))
            return {"ok": True}
        if op == "stop_load":
            if self._load is not None:
                self._load.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._load
                self._load = None
            return {"ok": True, "submitted": self._load_count}
        if op == "submit":
            prefix, steps = str(command["prefix"]), int(command["steps"])
            ids = [f"{prefix}-{i}" for i in range(int(command["count"]))]
            await asyncio.gather(*(self._spawn_submit(rid, steps) for rid in ids))
            return {"ok": True, "records": [asdict(self.records[rid]) for rid in ids]}
        if op == "ledger":
            return {"ok": True, "now": time.monotonic(),
                    "records": [asdict(r) for r in self.records.values()],
                    "transitions": self.transitions, "samples": list(self.samples),
                    "notices": self.notices,
                    "state_query_failures": self.state_query_failures,
                    "coordinator_pid": self.coordinator.pid,
                    "coordinator_alive": self.coordinator.is_alive()}
        if op == "transitions":
            return {"ok": True, "transitions": self.transitions}
        if op == "settle":
            return await self.settle(float(command.get("within", 20.0)))
        if op == "state":
            state = await self.client.query_state(timeout=5.0)
            return {"ok": True, "state": group_state_to_builtins(state)}
        if op == "http":
            return await asyncio.get_running_loop().run_in_executor(
                None, self.http_get, str(command["path"]))
        return {"ok": False, "error": f"unknown op {op!r}"}

    async def wait_ready(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(FrontendError):
                state = await self.client.query_state(timeout=1.0)
                if state.engines and all(e.state == "ready" for e in state.engines) \
                        and self.client.counts is not None:
                    return {"ok": True, "state": group_state_to_builtins(state)}
            await asyncio.sleep(0.05)
        return {"ok": False, "error": f"engines not all ready within {timeout:g} s"}

    async def settle(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._tasks and not self.open_ids():
                break
            await asyncio.sleep(0.05)
        return {"ok": True, "open": self.open_ids(), "pending_submits": len(self._tasks)}

    def http_get(self, path: str) -> dict[str, Any]:
        if self.metrics_port is None:
            return {"ok": False, "error": "started without --metrics-port"}
        url = f"http://127.0.0.1:{self.metrics_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=2.0) as response:
                body = response.read().decode()
                status = response.status
        except urllib.error.HTTPError as exc:
            body, status = exc.read().decode(), exc.code
        except OSError as exc:
            return {"ok": False, "error": f"GET {url}: {exc}"}
        if path == "/metrics":
            return {"ok": True, "status": status, "text": body}
        return {"ok": True, "status": status, "json": json.loads(body)}

    async def close(self) -> int:
        for task in list(self._tasks):
            task.cancel()
        if self._load is not None:
            self._load.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.client.close()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self.coordinator.shutdown, 5.0)


def reply(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


async def serve_commands(driver: Driver) -> int:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    watcher = asyncio.ensure_future(driver.watch_states())
    try:
        while True:
            line = await reader.readline()
            if not line:
                break  # the test closed our stdin (or died): stop everything
            command = json.loads(line)
            if command.get("op") == "quit":
                watcher.cancel()
                code = await driver.close()
                reply({"id": command.get("id"), "ok": True, "coordinator_exit": code})
                return 0
            try:
                answer = await driver.handle(command)
            except Exception as exc:
                log.exception("command %r failed", command)
                answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            reply({"id": command.get("id"), **answer})
    finally:
        watcher.cancel()
    await driver.close()
    return 0


async def amain(args: argparse.Namespace, serve_args: list[str]) -> int:
    extra = list(serve_args)
    if args.metrics_port is not None:
        extra += ["--metrics-port", str(args.metrics_port)]
    handle = await asyncio.get_running_loop().run_in_executor(None, lambda: launch(
        engines=args.engines, frontends=1, host=args.host, addr_file=args.addr_file,
        extra_args=extra, timeout=30.0))
    client = FrontendClient(handle.addresses, client_index=0, host=args.host,
                            call_timeout_s=SUBMIT_TIMEOUT_S)
    driver = Driver(handle, client, args.metrics_port)
    client.on_finished = driver.on_finished
    client.on_notice = driver.on_notice
    try:
        registered = await client.register(timeout=30.0)
    except BaseException:
        handle.shutdown(5.0)
        raise
    reply({"event": "registered", "coordinator_pid": handle.pid,
           "addresses": handle.addresses, "rank_count": registered.rank_count})
    return await serve_commands(driver)


def main(argv: list[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    serve_args: list[str] = []
    if "--" in raw:
        cut = raw.index("--")
        raw, serve_args = raw[:cut], raw[cut + 1:]
    parser = argparse.ArgumentParser(prog="python -m tests.netns.frontend_driver")
    parser.add_argument("--addr-file", required=True)
    parser.add_argument("--host", required=True, help="this host's sandbox address")
    parser.add_argument("--engines", type=int, required=True)
    parser.add_argument("--metrics-port", type=int)
    args = parser.parse_args(raw)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s [driver] %(name)s: %(message)s")
    return asyncio.run(amain(args, serve_args))


if __name__ == "__main__":
    raise SystemExit(main())
