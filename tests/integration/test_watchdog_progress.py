"""The hang watchdog sees progress a frontend saw: outputs streaming from vLLM-shaped engines.

vLLM engines report stats only when their request counts change, so a long
steady decode is silent on `back_output`. Its tokens still stream to the
frontend every step; the SDK's heartbeat says which ranks they came from, and
that is progress. When the stream stops (a hung collective), the alarm comes.
"""

from __future__ import annotations

import asyncio
import time

import zmq

from coordinator.frontend import FrontendClient
from tests import vllm_peers as peers
from tests.conftest import CoordinatorFactory

Ctx = zmq.Context[zmq.Socket[bytes]]
STALL_S = 1.5
STEP = 5.0


async def test_outputs_a_frontend_saw_keep_the_watchdog_quiet_and_their_end_alarms_it(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx,
) -> None:
    handle = coordinator(2, frontends=1, extra_args=["--watchdog-stall-s", str(STALL_S),
                                                     "--no-watchdog-rewake"])
    async with FrontendClient(handle.addresses, call_timeout_s=STEP) as client:
        await client.register()
        engines = peers.handshake_group(zmq_ctx, handle.addresses, [0, 1], dp_size=2)
        assert engines[0].init is not None
        outputs = zmq_ctx.socket(zmq.PUSH)
        outputs.setsockopt(zmq.LINGER, 0)
        outputs.connect(engines[0].init["addresses"]["outputs"][0])
        # Rank 0 reports that wave 0 started; after that no engine sends stats.
        engines[0].report(peers.engine_outputs(0, start_wave=0))
        await client.wait_for(lambda c: c.running, timeout=STEP)

        async def no_progress_alerts() -> int:
            return (await client.query_state()).counters.get("watchdog.no_progress", 0)

        # A steady decode: one token per step for one request, for twice the stall time.
        token = peers.engine_outputs(0, outputs=[["long", [7], None, None, None, None]])
        streaming_until = time.monotonic() + 2 * STALL_S + 1.0
        while time.monotonic() < streaming_until:
            outputs.send(token)
            await asyncio.sleep(0.05)
            assert await no_progress_alerts() == 0
        assert client.stats["heartbeats"] >= 3

        # The stream stops, as it does when a collective hangs: the alarm comes.
        stopped = time.monotonic()
        deadline = stopped + STALL_S + 3.0
        while await no_progress_alerts() == 0:
            assert time.monotonic() < deadline, "no alarm after the outputs stopped"
            await asyncio.sleep(0.1)
        assert time.monotonic() - stopped >= STALL_S - 0.5
        outputs.close(0)
        for engine in engines:
            engine.close()
