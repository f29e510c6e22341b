"""`--log-format json`: rank transitions, refusals, watchdog findings and restarts are
structured events with stable names, read from the real process's stderr."""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from coordinator.engine import EngineAgent, EngineRefused
from coordinator.launch import CoordinatorHandle, launch
from tests.conftest import CoordinatorFactory
from tests.integration.test_observability_e2e import STEP, short_steps, sim_group

pytestmark = pytest.mark.timeout(90)

JSON_LOGS = ("--log-format", "json")


def events(handle: CoordinatorHandle) -> list[dict[str, Any]]:
    """Every log line of the process, each parsed (a line that is not JSON fails)."""
    return [json.loads(line) for line in handle.stderr_text().splitlines() if line]


async def logged(handle: CoordinatorHandle, matches: Callable[[dict[str, Any]], bool],
                 what: str, timeout: float = 3 * STEP) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        found = [line for line in events(handle) if matches(line)]
        if found:
            return found[0]
        assert time.monotonic() < deadline, f"never logged: {what}"
        await asyncio.sleep(0.05)


async def test_rank_transitions_and_the_watchdog_are_events(
    coordinator: CoordinatorFactory
) -> None:
    handle = coordinator(2, transport="tcp", frontends=1,
                         extra_args=[*JSON_LOGS, "--watchdog-stall-s", "1.5"])
    async with sim_group(handle, 2, prefix="json") as group:
        ready = [line for line in events(handle) if line.get("event") == "rank_state"
                 and line["new"] == "ready"]
        assert sorted(line["rank"] for line in ready) == [0, 1]
        assert all(line["level"] == "info" and line["logger"] == "coordinator.server"
                   and line["old"] == "handshaking" and "cause" in line for line in ready)

        group.load.start_stream(0.02, short_steps)
        await group.client.wait_for(lambda c: c.running, timeout=STEP)
        group.engines.engine(1).freeze(silence=True)
        alert = await logged(handle, lambda e: e.get("event") == "watchdog"
                             and e["kind"] == "no_progress", "a no_progress watchdog event")
        assert alert["level"] == "error" and alert["ranks"] == [0, 1]
        assert alert["message"].startswith("WATCHDOG: ")
        rewake = await logged(handle, lambda e: e.get("event") == "watchdog_rewake",
                              "the watchdog's re-wake")
        assert rewake["wave"] == alert["wave"]
        await group.load.stop_stream()
        group.engines.engine(1).unfreeze()
        await group.load.all_finished(timeout=2 * STEP)


async def test_a_refused_engine_is_an_event(coordinator: CoordinatorFactory) -> None:
    handle = coordinator(1, extra_args=JSON_LOGS)
    agent = EngineAgent(handle.addresses["handshake"], 5, handshake_timeout_s=STEP,
                        ready_timeout_s=STEP, accept_timeout_s=STEP)
    with pytest.raises(EngineRefused):
        await agent.start()
    await agent.close(linger_s=0)
    refused = await logged(handle, lambda e: e.get("event") == "refused", "the refusal")
    assert refused["refused"] == "engine" and refused["rank"] == 5
    assert refused["identity"] == "0500" and refused["reason"]
    assert refused["level"] == "error" and refused["detail"] in refused["message"]


async def test_a_restart_from_the_state_file_is_an_event(tmp_path: Path) -> None:
    ipc_dir = tempfile.mkdtemp(prefix="dpc-json-")
    state = str(tmp_path / "state.json")
    extra = [*JSON_LOGS, "--state-file", state, "--ipc-dir", ipc_dir]
    first = launch(engines=1, lockstep=False, extra_args=extra,
                   addr_file=str(tmp_path / "a1.json"))
    try:
        agent = EngineAgent(first.addresses["handshake"], 0, handshake_timeout_s=STEP,
                            ready_timeout_s=STEP, accept_timeout_s=STEP)
        await agent.start()
        await logged(first, lambda e: e.get("event") == "rank_state" and e["new"] == "ready",
                     "rank 0 ready")
    finally:
        assert first.shutdown(timeout=STEP) == 0
    second = launch(engines=1, lockstep=False, extra_args=extra,
                    addr_file=str(tmp_path / "a2.json"))
    try:
        restored = await logged(second, lambda e: e.get("event") == "restored",
                                "the restore")
        assert restored["path"] == state and restored["registrations"] == 1
        started = await logged(second, lambda e: e.get("event") == "started", "start-up")
        assert started["version"]
    finally:
        await agent.close(linger_s=0)
        assert second.shutdown(timeout=STEP) == 0
        shutil.rmtree(ipc_dir, ignore_errors=True)
