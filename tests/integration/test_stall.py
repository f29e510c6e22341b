"""A stall of the coordinator itself never kills a healthy group, through the real process.

A coordinator with a short lease TTL, a group of simulated lockstep engines and
a frontend under steady load. The coordinator is stopped (SIGSTOP) for much
longer than the TTL, as a debugger, a frozen VM or a long pause would stop it,
and then continued. The engines never stopped: every rank must be ready again
within seconds (``/readyz`` answers 200 with no rank out: every lease alive,
none left expired), nothing may be reported failed or lost, every request
dispatched before the stall completes, and each rank takes a request soon after. The time to recover
and the requests lost are printed.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from coordinator.frontend import FinishedRequest, FrontendClient, Notice, SubmitError
from coordinator.launch import CoordinatorHandle, launch
from coordinator.protocol import frontend as fp
from coordinator.sim import SimConfig, SimEngineGroup, SimRequest, encode_sim_request

STALL_S = float(os.environ.get("DPC_STALL_S", "20"))
TTL_S = 2.0
ENGINES = 4
RATE = 40.0  # requests per second
LOAD_BEFORE_S = 2.0
LOAD_AFTER_S = 2.0
STEPS = (20, 120)  # 0.1 to 0.6 s of decode at 5 ms a step
# A bound on recovery, not a measure of it (the test prints that): wide enough for a
# loaded machine, far shorter than a group that never recovers.
RECOVER_WITHIN_S = 20.0
SETTLE_S = 20.0

pytestmark = pytest.mark.timeout(STALL_S + 150)


@dataclass
class Ledger:
    """Every request the frontend sent, and how it ended."""

    sent_at: dict[str, float] = field(default_factory=dict)
    submitted: dict[str, float] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)

    def on_finished(self, done: FinishedRequest) -> None:
        self.finished.add(done.request_id)

    def on_notice(self, notice: Notice) -> None:
        if isinstance(notice, fp.RequestsFailed):
            self.failed.update(notice.request_ids)

    def open(self) -> list[str]:
        return [rid for rid in self.submitted if rid not in self.finished | self.failed]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _readyz(port: int) -> int:
    return _readiness(port)[0]


def _readiness(port: int) -> tuple[int, object]:
    """/readyz's status and the ranks it names as taking no requests."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2.0) as reply:
            return int(reply.status), json.loads(reply.read()).get("ranks_out")
    except urllib.error.HTTPError as exc:
        with exc:
            return int(exc.code), json.loads(exc.read()).get("ranks_out")


@pytest.fixture
def coordinator_process(tmp_path: Path) -> Iterator[tuple[CoordinatorHandle, int]]:
    ipc = tmp_path / "ipc"
    if len(str(ipc)) > 80:
        pytest.skip("temporary path too long for ipc sockets")
    port = _free_port()
    handle = launch(engines=ENGINES, frontends=1, addr_file=str(tmp_path / "coord.json"),
                    extra_args=["--ipc-dir", str(ipc), "--lease-ttl-s", str(TTL_S),
                                "--metrics-port", str(port)],
                    timeout=20.0)
    try:
        yield handle, port
    finally:
        os.kill(handle.pid, signal.SIGCONT)  # never leave it stopped
        handle.shutdown(timeout=5.0)


async def _submit(client: FrontendClient, ledger: Ledger, request_id: str, steps: int,
                  rank: int | None = None) -> None:
    ledger.sent_at[request_id] = time.monotonic()
    payload = encode_sim_request(SimRequest(request_id, 0, client.wave, steps))
    try:
        await client.submit(request_id, [payload], dp_rank=rank)
    except SubmitError as exc:
        ledger.refused[request_id] = exc.code
        return
    ledger.submitted[request_id] = time.monotonic()


async def _load(client: FrontendClient, ledger: Ledger, prefix: str, seconds: float,
                tasks: set[asyncio.Task[None]]) -> None:
    end = time.monotonic() + seconds
    index = 0
    while time.monotonic() < end:
        steps = STEPS[0] + (index * 37) % (STEPS[1] - STEPS[0])
        task = asyncio.ensure_future(_submit(client, ledger, f"{prefix}-{index}", steps))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        index += 1
        await asyncio.sleep(1.0 / RATE)


async def test_a_stall_far_longer_than_the_lease_ttl_kills_no_rank_and_loses_no_request(
    coordinator_process: tuple[CoordinatorHandle, int],
) -> None:
    handle, port = coordinator_process
    ledger = Ledger()
    client = FrontendClient(handle.addresses, client_index=0, call_timeout_s=STALL_S + 15.0,
                            on_finished=ledger.on_finished, on_notice=ledger.on_notice)
    group = SimEngineGroup(handle.addresses["handshake"], ENGINES, config=SimConfig(
        step_time_s=0.005, collective_timeout_s=STALL_S + 60.0, heartbeat_interval_s=0.5))
    tasks: set[asyncio.Task[None]] = set()
    try:
        await asyncio.wait_for(client.register(), 10.0)
        await asyncio.wait_for(group.start(), 20.0)
        await _load(client, ledger, "before", LOAD_BEFORE_S, tasks)
        assert await asyncio.to_thread(_readyz, port) == 200
        dispatched_before = set(ledger.submitted)
        assert dispatched_before and client.in_flight, "no request in flight at the stall"

        os.kill(handle.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        await _load(client, ledger, "during", STALL_S, tasks)  # they wait for their reply
        os.kill(handle.pid, signal.SIGCONT)
        resumed_at = time.monotonic()
        print(f"\ncoordinator stopped for {resumed_at - stopped_at:.1f} s "
              f"(--lease-ttl-s {TTL_S:g})")

        state = await asyncio.wait_for(client.query_state(timeout=RECOVER_WITHIN_S),
                                       RECOVER_WITHIN_S)
        answered_at = time.monotonic()
        assert [e.state for e in state.engines] == ["ready"] * ENGINES, state.engines
        # Every lease alive again: none left past its TTL by the time spent stopped.
        while await asyncio.to_thread(_readiness, port) != (200, {}):
            assert time.monotonic() < resumed_at + RECOVER_WITHIN_S, (
                "/readyz still says not ready: leases left expired by the stall")
            await asyncio.sleep(0.05)
        ready_at = time.monotonic()
        # Every rank takes a request of its own, and finishes it, within seconds.
        probes = [asyncio.ensure_future(_submit(client, ledger, f"probe-{rank}", 5, rank))
                  for rank in range(ENGINES)]
        await asyncio.wait_for(asyncio.gather(*probes), RECOVER_WITHIN_S)
        probe_ids = {f"probe-{rank}" for rank in range(ENGINES)}
        assert probe_ids <= set(ledger.submitted), ledger.refused
        deadline = time.monotonic() + RECOVER_WITHIN_S
        while not probe_ids <= ledger.finished and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        recovered_at = time.monotonic()
        assert probe_ids <= ledger.finished, "a rank took no request after the stall"

        await _load(client, ledger, "after", LOAD_AFTER_S, tasks)
        await asyncio.wait_for(asyncio.gather(*list(tasks), return_exceptions=True), 30.0)
        deadline = time.monotonic() + SETTLE_S
        while ledger.open() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

        final = await client.query_state()
        counters = final.counters
        lost = ledger.open()
        print(f"recovery after SIGCONT: state answered in {answered_at - resumed_at:.3f} s, "
              f"/readyz 200 in {ready_at - resumed_at:.3f} s, "
              f"every rank ran a new request in {recovered_at - resumed_at:.3f} s; "
              f"requests: {len(ledger.sent_at)} sent, {len(ledger.submitted)} submitted, "
              f"{len(ledger.finished)} finished, {len(ledger.failed)} failed, "
              f"{len(ledger.refused)} refused, {len(lost)} lost; "
              f"pauses credited: {counters.get('coordinator.pauses', 0)}")
        assert counters.get("lease.dead", 0) == 0, counters
        assert counters.get("coordinator.pauses", 0) >= 1, counters
        assert not ledger.failed, sorted(ledger.failed)[:10]
        assert not ledger.refused, dict(list(ledger.refused.items())[:10])
        assert not lost, lost[:10]
        assert dispatched_before <= ledger.finished
        assert [e.state for e in final.engines] == ["ready"] * ENGINES
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.wait_for(client.close(), 10.0)
        await asyncio.wait_for(group.stop(), 20.0)
