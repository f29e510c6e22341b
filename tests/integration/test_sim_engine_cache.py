"""A simulated engine's KV cache seen from outside: by a frontend and by the coordinator."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.frontend import FrontendClient
from coordinator.launch import launch
from coordinator.protocol.vllm import EngineCoreOutputs
from coordinator.sim import SimConfig, SimEngineGroup
from coordinator.sim.outputs import read_token_outputs
from coordinator.sim.request import FINISH_ERROR, encode_vllm_request

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="dps-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


async def _until(predicate: object, what: str, timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await predicate():  # type: ignore[operator]
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def test_a_dense_engine_reports_cache_use_refuses_the_impossible_and_resets(
        short_tmp: Path) -> None:
    handle = launch(engines=1, frontends=1, addr_file=str(short_tmp / "coord.json"),
                    lockstep=False, extra_args=["--ipc-dir", str(short_tmp / "ipc")],
                    timeout=20.0)
    group = SimEngineGroup(handle.addresses["handshake"], 1, config=SimConfig(
        lockstep=False, step_time_s=0.02, block_size=4, kv_blocks=16))
    seen: list[tuple[EngineCoreOutputs, float]] = []
    client = FrontendClient(handle.addresses, on_outputs=lambda m, at: seen.append((m, at)))
    finished: set[str] = set()
    client.on_finished = lambda item: finished.add(item.request_id)
    try:
        await asyncio.wait_for(asyncio.gather(client.register(), group.start()), 20.0)
        engine = group.engines[0]

        async def ready() -> bool:
            state = await client.query_state()
            return [e.state for e in state.engines] == ["ready"]

        await _until(ready, "the engine to be ready")

        async def submit(request_id: str, prompt: list[int], max_tokens: int) -> None:
            payload = encode_vllm_request(request_id, prompt, max_tokens=max_tokens)
            await client.submit(request_id, [payload])

        # More blocks than the whole cache: refused at once, with vLLM's ERROR reason.
        await submit("huge", list(range(100)), 1)

        async def huge_done() -> bool:
            return "huge" in finished

        await _until(huge_done, "the refusal")
        refusal = [r for m, _ in seen for r in read_token_outputs(m.outputs)]
        assert [(r.request_id, r.finished) for r in refusal] == [("huge", True)]
        assert any(FINISH_ERROR in (o[5] for o in m.outputs) for m, _ in seen)
        assert engine.counters.rejected == 1

        # A running request holds blocks: the coordinator sees the engine's KV usage,
        # and a reset is refused until it is done.
        await submit("long", list(range(20)), 30)

        async def usage_seen() -> bool:
            state = await client.query_state()
            return state.engines[0].kv_cache_usage > 0

        await _until(usage_seen, "the engine to report KV usage")
        assert not engine.reset_prefix_cache()

        async def long_done() -> bool:
            return "long" in finished

        await _until(long_done, "the long request")
        assert engine.scheduler.pool.num_cached == (20 + 30 - 1) // 4
        assert engine.reset_prefix_cache() and engine.scheduler.pool.num_cached == 0
        first = [(r, at) for m, at in seen for r in read_token_outputs(m.outputs)
                 if r.request_id == "long" and r.prompt_tokens is not None]
        assert len(first) == 1 and first[0][0].cached_tokens == 0
        stats = [m.scheduler_stats for m, _ in seen if m.scheduler_stats is not None]
        assert [s.prefix_cache_stats.queries for s in stats] == [20]
        assert engine.summary()["prefix_cache_resets"] == 1
    finally:
        await asyncio.wait_for(client.close(), 10.0)
        await asyncio.wait_for(group.stop(), 20.0)
        handle.shutdown(timeout=5.0)
