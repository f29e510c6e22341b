"""Prefix-cache routing against simulated engines with a real prefix cache.

The engines (``coordinator.sim``) cache prompt blocks as vLLM does, publish
vLLM's KV events on vLLM's endpoint convention with a replay socket, and
announce their publisher and block size in their greeting; the coordinator
runs ``--policy prefix`` with no KV flag at all. A frontend submits the turns
of conversations as vLLM ``EngineCoreRequest`` payloads, each turn repeating
the previous prompt and answer and adding to them, and reads the engines'
own account of each prompt (vLLM's ``PrefillStats``: tokens computed and
found cached).
"""

from __future__ import annotations

import asyncio
import random
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.frontend import FrontendClient
from coordinator.launch import launch
from coordinator.sim import SimConfig, SimEngineGroup
from coordinator.sim.outputs import read_token_outputs
from coordinator.sim.request import answer_tokens, encode_vllm_request

pytestmark = pytest.mark.timeout(90)

STEP = 10.0
ENGINES = 4
BLOCK = 16
ANSWER = 8


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="dpp-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def free_port_run(count: int) -> int:
    for base in range(42000, 60000, 113):
        sockets = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise AssertionError("no free ports")


async def test_each_conversation_stays_where_its_history_is_cached(short_tmp: Path) -> None:
    handle = launch(engines=ENGINES, frontends=1, addr_file=str(short_tmp / "coord.json"),
                    timeout=20.0, extra_args=["--ipc-dir", str(short_tmp / "ipc"),
                                              "--policy", "prefix"])
    base = free_port_run(2 * ENGINES)
    group = SimEngineGroup(handle.addresses["handshake"], ENGINES, config=SimConfig(
        step_time_s=0.002, block_size=BLOCK, kv_blocks=512,
        kv_events_endpoint=f"tcp://*:{base}",
        kv_events_replay_endpoint=f"tcp://*:{base + ENGINES}"),
        collective_address="tcp://127.0.0.1:0")
    reports: dict[str, Any] = {}

    def on_outputs(message: Any, at: float) -> None:
        for report in read_token_outputs(message.outputs):
            if report.prompt_tokens is not None:
                reports[report.request_id] = report

    client = FrontendClient(handle.addresses, on_outputs=on_outputs, call_timeout_s=STEP)
    finished: set[str] = set()
    client.on_finished = lambda item: finished.add(item.request_id)
    rng = random.Random(3)
    try:
        await asyncio.wait_for(asyncio.gather(client.register(), group.start()), 30.0)
        histories = {f"chat-{i}": [rng.randrange(1000, 30000) for _ in range(5 * BLOCK)]
                     for i in range(ENGINES)}
        ranks: dict[str, list[int]] = {session: [] for session in histories}
        for turn in range(4):
            for session, history in histories.items():
                request_id = f"{session}-{turn}"
                payload = encode_vllm_request(request_id, history, max_tokens=ANSWER,
                                              session_id=session, current_wave=client.wave)
                submitted = await client.submit(request_id, [payload])
                ranks[session].append(submitted.rank)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + STEP
            while not all(f"{s}-{turn}" in finished for s in histories):
                assert loop.time() < deadline, f"turn {turn} did not finish"
                await asyncio.sleep(0.02)
            for history in histories.values():
                history += answer_tokens(history, ANSWER)
                history += [rng.randrange(1000, 30000) for _ in range(2 * BLOCK)]
            await asyncio.sleep(0.2)  # the engines' KV events reach the coordinator
        for session, where in ranks.items():
            assert len(set(where)) == 1, (session, where)  # never moved off its cache
        assert len({where[0] for where in ranks.values()}) > 1  # new sessions spread
        # The engines' own word: every later turn found its history cached.
        for session in histories:
            for turn in range(1, 4):
                report = reports[f"{session}-{turn}"]
                assert report.cached_tokens >= report.prompt_tokens - 3 * BLOCK - ANSWER, (
                    session, turn, report)
        # What the coordinator expected to hit is what the engines found cached.
        state = await client.query_state()
        assert state.counters["route.cached_tokens"] == sum(
            report.cached_tokens for report in reports.values())
        assert state.counters.get("kv.lost_batches", 0) == 0
    finally:
        await asyncio.wait_for(client.close(), STEP)
        await asyncio.wait_for(group.stop(), 20.0)
        assert handle.shutdown(timeout=5.0) == 0, handle.stderr_text()[-3000:]
