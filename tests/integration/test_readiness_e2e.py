"""/readyz through the real process: routine maintenance keeps the group ready; a group
that cannot take a request is not (the rule is core.ranks.readiness)."""

from __future__ import annotations

import asyncio
import json
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from coordinator.frontend import FrontendClient
from coordinator.sim import SimConfig, SimEngineGroup
from tests.conftest import CoordinatorFactory
from tests.integration.test_observability_e2e import free_port

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]

STEP = 5.0


def readyz(port: int) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=STEP) as reply:
            return int(reply.status), json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return int(exc.code), json.loads(exc.read())


def metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=STEP) as reply:
        return str(reply.read().decode())


async def until_readyz(port: int, status: int, what: str,
                       out: dict[str, str] | None = None) -> dict[str, Any]:
    """Poll until /readyz answers `status` (with `out` as its ranks out, if given)."""
    deadline = time.monotonic() + 4 * STEP
    while True:
        got, body = await asyncio.to_thread(readyz, port)
        if got == status and (out is None or body.get("ranks_out") == out):
            return body
        assert time.monotonic() < deadline, f"/readyz never {status} ({what}): {got} {body}"
        await asyncio.sleep(0.05)


async def cli(*args: str) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "coordinator", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(process.communicate(), 4 * STEP)
    assert process.returncode is not None
    return process.returncode, out.decode()


async def test_a_drain_keeps_the_group_ready_and_a_dead_group_is_not(
    coordinator: CoordinatorFactory,
) -> None:
    port = free_port()
    handle = coordinator(2, frontends=1, extra_args=["--metrics-port", str(port)])
    client = FrontendClient(handle.addresses, client_index=0, call_timeout_s=STEP)
    group = SimEngineGroup(handle.addresses["handshake"], 2, config=SimConfig(
        heartbeat_interval_s=0.5, handshake_timeout_s=STEP, ready_timeout_s=2 * STEP,
        accept_timeout_s=STEP))
    stopped = False
    try:
        await asyncio.wait_for(client.register(), STEP)
        await asyncio.wait_for(group.start(), 3 * STEP)
        body = await until_readyz(port, 200, "both ranks ready")
        assert "dp_coordinator_group_serves 1.0" in await asyncio.to_thread(metrics, port)
        assert body["reason"] == "all 2 ranks take requests"

        code, out = await cli("drain", "1", "--addr-file", handle.addr_file)
        assert code == 0, out
        assert "dp_rank=1 is now draining" in out
        # The snapshot follows within moments; /readyz stays 200 all along.
        deadline = time.monotonic() + 4 * STEP
        while True:
            got, body = await asyncio.to_thread(readyz, port)
            assert got == 200, body
            if body["ranks_out"] == {"1": "draining"}:
                break
            assert time.monotonic() < deadline, body
            await asyncio.sleep(0.05)
        assert body["reason"] == "1 of 2 ranks take requests (1 draining)"
        code, out = await cli("cordon", "0", "--addr-file", handle.addr_file)
        assert code == 0, out
        body = await until_readyz(port, 503, "every rank out for maintenance")
        assert "every rank is cordoned or draining" in body["reason"]
        code, out = await cli("uncordon", "0", "--addr-file", handle.addr_file)
        assert code == 0, out
        await until_readyz(port, 200, "rank 0 back", out={"1": "draining"})

        await asyncio.wait_for(group.stop(), 2 * STEP)
        stopped = True
        body = await until_readyz(port, 503, "every rank dead", out={"0": "dead", "1": "dead"})
        assert body["reason"] == "no rank can take requests (2 dead)", body
        assert "dp_coordinator_group_serves 0.0" in await asyncio.to_thread(metrics, port)
    finally:
        if not stopped:
            await asyncio.wait_for(group.stop(), 2 * STEP)
        await asyncio.wait_for(client.close(), STEP)
