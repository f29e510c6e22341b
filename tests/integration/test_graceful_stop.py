"""Planned maintenance: a graceful stop refuses new submits with `shutting_down`, lets
the requests in flight finish, then exits 0; from SIGTERM with `--graceful-stop-s` and
from `dp-coordinator stop --graceful`, through the real process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time

import pytest

from coordinator.frontend import SubmitError
from coordinator.launch import CoordinatorHandle
from coordinator.protocol import frontend as fp
from tests.conftest import CoordinatorFactory
from tests.integration.test_observability_e2e import STEP, Group, sim_group

pytestmark = pytest.mark.timeout(120)

CLI = (sys.executable, "-m", "coordinator")


async def exited(handle: CoordinatorHandle, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while handle.returncode is None:
        assert time.monotonic() < deadline, "the coordinator did not exit"
        await asyncio.sleep(0.05)
    return handle.returncode


def events(handle: CoordinatorHandle, name: str) -> list[dict[str, object]]:
    lines = [json.loads(line) for line in handle.stderr_text().splitlines() if line]
    return [line for line in lines if line.get("event") == name]


async def refused_while_stopping(group: Group, handle: CoordinatorHandle) -> SubmitError:
    """Submit until the coordinator refuses (the stop is asynchronous to us)."""
    deadline = time.monotonic() + STEP
    while True:
        try:
            await group.load.submit(1)
        except SubmitError as exc:
            return exc
        assert time.monotonic() < deadline, "submits were never refused"
        assert handle.returncode is None
        await asyncio.sleep(0.02)


async def held_in_flight(group: Group, count: int) -> set[str]:
    """``count`` requests that cannot finish while both engines are frozen."""
    for rank in (0, 1):
        group.engines.engine(rank).freeze()
    return {await group.load.submit(50) for _ in range(count)}


async def stop_gracefully_by(how: str, handle: CoordinatorHandle) -> None:
    if how == "sigterm":
        os.kill(handle.pid, signal.SIGTERM)
        return
    proc = await asyncio.create_subprocess_exec(
        *CLI, "stop", "--graceful", "--addr-file", handle.addr_file,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 2 * STEP)
    assert proc.returncode == 0, err.decode()
    assert "new submits are refused" in out.decode()


@pytest.mark.parametrize("how", ["sigterm", "cli"])
async def test_a_graceful_stop_waits_for_the_requests_in_flight(
    coordinator: CoordinatorFactory, how: str
) -> None:
    graceful = ["--graceful-stop-s", "60"] if how == "sigterm" else []
    handle = coordinator(2, frontends=1, extra_args=[*graceful, "--log-format", "json"])
    async with sim_group(handle, 2, prefix=how) as group:
        held = await held_in_flight(group, 4)
        await stop_gracefully_by(how, handle)
        refusal = await refused_while_stopping(group, handle)
        assert refusal.code == fp.ERR_SHUTTING_DOWN and "graceful stop" in str(refusal)
        held = set(group.load.submitted)  # with any accepted before the stop took hold
        state = await group.client.query_state(timeout=STEP)
        assert state.shutting_down and state.in_flight == len(held)
        assert handle.returncode is None  # still serving what is in flight

        for rank in (0, 1):
            group.engines.engine(rank).unfreeze()
        await group.load.all_finished(timeout=4 * STEP)
        assert held <= group.load.finished
        assert await exited(handle, 4 * STEP) == 0
    (began,) = events(handle, "graceful_stop")
    assert began["in_flight"] == len(held)
    (ended,) = events(handle, "graceful_stop_ended")
    assert ended["in_flight"] == 0
    assert not os.path.exists(handle.addr_file)


async def test_the_deadline_ends_a_graceful_stop(coordinator: CoordinatorFactory) -> None:
    handle = coordinator(2, frontends=1,
                         extra_args=["--graceful-stop-s", "1", "--log-format", "json"])
    async with sim_group(handle, 2, prefix="deadline") as group:
        held = await held_in_flight(group, 2)
        stopped_at = time.monotonic()
        os.kill(handle.pid, signal.SIGTERM)
        assert await exited(handle, 4 * STEP) == 0
        assert time.monotonic() - stopped_at >= 1.0
        for rank in (0, 1):
            group.engines.engine(rank).unfreeze()
    (ended,) = events(handle, "graceful_stop_ended")
    assert ended["in_flight"] == len(held) and ended["level"] == "warning"


async def test_without_the_flag_sigterm_stops_at_once(coordinator: CoordinatorFactory) -> None:
    handle = coordinator(2, frontends=1, extra_args=["--log-format", "json"])
    async with sim_group(handle, 2, prefix="plain") as group:
        await held_in_flight(group, 2)
        os.kill(handle.pid, signal.SIGTERM)
        assert await exited(handle, 4 * STEP) == 0
        for rank in (0, 1):
            group.engines.engine(rank).unfreeze()
    assert events(handle, "graceful_stop") == []


async def test_a_plain_stop_from_the_cli(coordinator: CoordinatorFactory) -> None:
    handle = coordinator(1)
    proc = await asyncio.create_subprocess_exec(
        *CLI, "stop", "--addr-file", handle.addr_file, "--wait", str(4 * STEP),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 6 * STEP)
    assert proc.returncode == 0, err.decode()
    assert out.decode().splitlines() == ["the coordinator is stopping",
                                         "the coordinator has exited"]
    assert await exited(handle, STEP) == 0
