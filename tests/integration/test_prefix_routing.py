"""Prefix-cache routing end to end: a real coordinator process, real engines' sockets,
publishers of vLLM's KV event bytes, and frontends submitting vLLM ADD payloads.

Each rank's publisher is a ``tests.integration.kv_publishers.Publisher``: vLLM
0.33's bytes, with batches that can be left out of the live stream while kept
in the replay buffer (a sequence gap the coordinator must fill). Engines are
``EngineAgent``s, so the test sees exactly which rank each ADD reaches and
decides what load each rank reports.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio

from coordinator.engine import AddRequest, EngineAgent, default_ready_response
from coordinator.frontend import FrontendClient
from coordinator.launch import CoordinatorHandle, launch
from coordinator.protocol import frontend as fp
from coordinator.protocol.kv_events import AllBlocksCleared, BlockStored
from tests.integration.kv_publishers import Publisher, bind_publishers
from tests.unit.test_engine_request import add_fields

pytestmark = pytest.mark.timeout(90)

STEP = 5.0
BLOCK = 16
ENGINES = 2


def add_payload(request_id: str, tokens: list[int]) -> bytes:
    return msgspec.msgpack.encode(add_fields(request_id=request_id, prompt_token_ids=tokens))


def stored(tokens: list[int], first_hash: int, parent: int | None = None) -> BlockStored:
    return BlockStored(block_hashes=[first_hash + i for i in range(len(tokens) // BLOCK)],
                       parent_block_hash=parent, token_ids=tokens, block_size=BLOCK,
                       lora_id=None, medium="GPU", lora_name=None)


class Rig:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.ctx = zmq.asyncio.Context()
        self.publishers: list[Publisher] = []
        self.agents: list[EngineAgent] = []
        self.handle: CoordinatorHandle | None = None
        self.client: FrontendClient | None = None
        self.step = 0

    async def start(self, *extra: str) -> None:
        self.publishers, live, replay = bind_publishers(self.ctx, ENGINES)
        ipc = self.tmp_path / "ipc"
        ipc.mkdir()
        self.handle = launch(
            engines=ENGINES, addr_file=str(self.tmp_path / "addresses.json"), timeout=20.0,
            extra_args=["--ipc-dir", str(ipc), "--policy", "prefix",
                        "--kv-events-endpoint", f"tcp://*:{live}",
                        "--kv-events-replay-endpoint", f"tcp://*:{replay}",
                        "--kv-block-size", str(BLOCK), "--lease-ttl-s", "1.5", *extra],
        )
        for publisher in self.publishers:
            await publisher.wait_subscribed()
        # The frontend registers first, so that the engines' INITs carry its outputs.
        self.client = FrontendClient(self.handle.addresses, client_index=0,
                                     ipc_dir=str(ipc), call_timeout_s=STEP)
        await self.client.register()
        self.agents = [EngineAgent(self.handle.addresses["handshake"], rank,
                                   heartbeat_interval_s=0.2, handshake_timeout_s=STEP,
                                   ready_timeout_s=STEP, accept_timeout_s=STEP)
                       for rank in range(ENGINES)]
        await asyncio.wait_for(asyncio.gather(*(a.start() for a in self.agents)), STEP * 2)
        await self.wait_counter("dispatch.greetings", lambda v: v >= ENGINES)

    async def counters(self) -> dict[str, int]:
        assert self.client is not None
        return dict((await self.client.query_state()).counters)

    async def wait_counter(self, name: str, check: Callable[[int], bool]) -> None:
        deadline = time.monotonic() + STEP
        while True:
            value = (await self.counters()).get(name, 0)
            if check(value):
                return
            assert time.monotonic() < deadline, f"{name} stayed at {value}"
            await asyncio.sleep(0.02)

    async def submit(self, request_id: str, tokens: list[int]) -> int:
        assert self.client is not None
        reply = await self.client.submit(request_id, [add_payload(request_id, tokens)])
        add = await self.next_add(self.agents[reply.rank])
        assert add.frames[0] == add_payload(request_id, tokens)  # untouched, to that rank
        return reply.rank

    @staticmethod
    async def next_add(agent: EngineAgent) -> AddRequest:
        deadline = time.monotonic() + STEP
        while True:
            item = await agent.recv_request(timeout_s=max(0.01, deadline - time.monotonic()))
            if isinstance(item, AddRequest):
                return item

    def report(self, rank: int, waiting: int = 0, running: int = 0) -> None:
        self.step += 1
        self.agents[rank].send_stats(waiting=waiting, running=running, kv_cache_usage=0.1,
                                     step_counter=self.step, current_wave=0)

    async def close(self) -> None:
        if self.client is not None:
            await asyncio.wait_for(self.client.close(), STEP)
        for agent in self.agents:
            await asyncio.wait_for(agent.close(linger_s=0.0), STEP)
        for publisher in self.publishers:
            publisher.close()
        self.ctx.term()
        if self.handle is not None:
            code = self.handle.shutdown(timeout=5.0)
            if code != 0:
                print(self.handle.stderr_text()[-4000:])


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    made = Rig(tmp_path)
    try:
        await made.start()
        yield made
    finally:
        await made.close()


PROMPT = list(range(1000, 1000 + 4 * BLOCK))


async def test_the_rank_holding_the_prefix_gets_the_request(rig: Rig) -> None:
    rig.publishers[1].publish(stored(PROMPT, 10))
    await rig.wait_counter("prefix_index.stored_blocks", lambda v: v >= 4)
    for turn in range(3):
        assert await rig.submit(f"hit-{turn}", [*PROMPT, turn]) == 1
        # Both ranks report between turns (idle: the requests finished at once).
        rig.report(0)
        rig.report(1)
        await rig.wait_counter("stats.reports", lambda v, turn=turn: v >= 2 * (turn + 1))
    counters = await rig.counters()
    assert counters["route.decisions.prefix"] == 3
    assert counters["route.cached_tokens"] == 3 * 4 * BLOCK


async def test_the_busiest_rank_is_not_chosen_however_much_it_caches(rig: Rig) -> None:
    rig.publishers[1].publish(stored(PROMPT, 10))
    await rig.wait_counter("prefix_index.stored_blocks", lambda v: v >= 4)
    rig.report(1, waiting=40, running=8)
    rig.report(0, running=1)
    await rig.wait_counter("stats.reports", lambda v: v >= 2)
    for turn in range(3):
        assert await rig.submit(f"busy-{turn}", [*PROMPT, turn]) == 0


async def test_a_sequence_gap_is_filled_by_replay(rig: Rig) -> None:
    publisher = rig.publishers[0]
    publisher.publish(stored(PROMPT[:BLOCK], 10))
    publisher.publish(stored(PROMPT[BLOCK:3 * BLOCK], 11, parent=10), deliver=False)
    publisher.publish(stored(PROMPT[3 * BLOCK:], 13, parent=12))
    await rig.wait_counter("prefix_index.stored_blocks", lambda v: v >= 4)
    # Each connection asked for everything from 0 once; the gap, from 1.
    assert publisher.replays_served == [0, 1]
    assert await rig.submit("after-gap", [*PROMPT, 1]) == 0
    counters = await rig.counters()
    assert counters["route.cached_tokens"] == 4 * BLOCK  # every block, the replayed ones too
    assert "kv.resets.gap" not in counters and counters["kv.gaps"] == 1


async def test_all_blocks_cleared_empties_the_rank(rig: Rig) -> None:
    publisher = rig.publishers[1]
    publisher.publish(stored(PROMPT, 10))
    await rig.wait_counter("prefix_index.stored_blocks", lambda v: v >= 4)
    rig.report(1, running=1)  # rank 1 now costs a little more: only its cache could win it
    await rig.wait_counter("stats.reports", lambda v: v >= 1)
    assert await rig.submit("before", [*PROMPT, 1]) == 1
    publisher.publish(AllBlocksCleared())
    await rig.wait_counter("kv.events.cleared", lambda v: v == 1)
    rig.report(1, running=1)
    await rig.wait_counter("stats.reports", lambda v: v >= 2)
    assert await rig.submit("after", [*PROMPT, 2]) == 0


async def test_a_dead_rank_keeps_its_index_until_a_new_engine_replaces_it(rig: Rig) -> None:
    rig.publishers[1].publish(stored(PROMPT, 10))
    await rig.wait_counter("prefix_index.stored_blocks", lambda v: v >= 4)
    await rig.agents[1].close(linger_s=0.0)  # the engine process is gone
    await rig.wait_counter("lease.dead", lambda v: v == 1)
    # It may come back with the same cache: the index is kept (it is not routed to).
    assert "kv.resets.rank_gone" not in await rig.counters()
    # A new engine takes the rank: its index starts empty, its stream from scratch.
    rig.agents[1] = EngineAgent(rig.agents[0].handshake_address, 1, heartbeat_interval_s=0.2,
                                handshake_timeout_s=STEP, ready_timeout_s=STEP,
                                accept_timeout_s=STEP)
    await asyncio.wait_for(rig.agents[1].start(), STEP * 2)
    await rig.wait_counter("kv.resets.rank_replaced", lambda v: v == 1)
    await rig.wait_counter("dispatch.greetings", lambda v: v >= 3)
    rig.report(1, running=1)
    await rig.wait_counter("stats.reports", lambda v: v >= 1)
    assert await rig.submit("reborn", [*PROMPT, 1]) == 0
    assert (await rig.counters()).get("route.cached_tokens", 0) == 0


async def test_a_publishers_garbage_is_counted_and_the_stream_goes_on(rig: Rig) -> None:
    publisher = rig.publishers[1]
    publisher.publish(stored(PROMPT[:BLOCK], 10))
    await rig.wait_counter("prefix_index.stored_blocks", lambda v: v >= 1)
    # Not three frames; a readable number with a payload that is not msgpack; a frame
    # past the message size bound (the coordinator drops that connection).
    publisher.live.send_multipart([b"only one frame"])
    publisher.live.send_multipart([b"", (1).to_bytes(8, "big"), b"\xc1\xc1"])
    publisher.live.send_multipart([b"", (2).to_bytes(8, "big"), b"x" * (17 << 20)])
    await rig.wait_counter("kv.bad_batches.decode", lambda v: v == 1)
    counters = await rig.counters()
    assert counters["kv.bad_batches.frame_count"] == 1
    assert counters["kv.resets.bad_batch"] == 1  # the index of rank 1 was emptied
    # The publisher goes on (its numbering too); so does the coordinator.
    publisher.buffer.extend([(1, b"\xc1\xc1"), (2, b"")])  # what was sent, as a buffer would
    publisher.publish(stored(PROMPT, 20))
    # The connection the oversized message ended is made again, and catches up.
    await rig.wait_counter("kv.connections", lambda v: v >= 3)
    await rig.wait_counter("prefix_index.stored_blocks", lambda v: v >= 5)
    assert await rig.submit("after-garbage", [*PROMPT, 1]) == 1


async def test_engines_that_announce_their_publishers_are_followed_there(
    tmp_path: Path,
) -> None:
    """No --kv-events-endpoint: each engine's greeting on dispatch names its publisher
    (a wildcard host, as vLLM reports `tcp://*:PORT`) and its block size; the
    coordinator, on tcp, follows it on the host the engine connected from."""
    ctx = zmq.asyncio.Context()
    publishers, live, replay = bind_publishers(ctx, ENGINES)
    handle = launch(engines=ENGINES, host="127.0.0.1", addr_file=str(tmp_path / "a.json"),
                    timeout=20.0, extra_args=["--policy", "prefix"])
    agents = []
    try:
        for rank in range(ENGINES):
            greeting = default_ready_response(rank, ENGINES)
            greeting.block_size = BLOCK
            greeting.kv_events_config = {
                "enable_kv_cache_events": True, "publisher": "zmq",
                "endpoint": f"tcp://*:{live + rank}",
                "replay_endpoint": f"tcp://*:{replay + rank}", "topic": ""}
            agents.append(EngineAgent(handle.addresses["handshake"], rank,
                                      ready_response=greeting, heartbeat_interval_s=0.2,
                                      handshake_timeout_s=STEP, ready_timeout_s=STEP,
                                      accept_timeout_s=STEP))
        await asyncio.wait_for(asyncio.gather(*(a.start() for a in agents)), STEP * 2)
        for publisher in publishers:
            await publisher.wait_subscribed()
        publishers[1].publish(stored(PROMPT, 10))
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(handle.addresses["frontend"])
        deadline = time.monotonic() + STEP
        while True:
            await sock.send(fp.encode(fp.QueryState(1)))
            assert await sock.poll(int(STEP * 1000))
            state = fp.decode_reply(await sock.recv())
            assert isinstance(state, fp.StateReply)
            if state.state.counters.get("prefix_index.stored_blocks", 0) >= 4:
                break
            assert time.monotonic() < deadline, state.state.counters
            await asyncio.sleep(0.02)
        await sock.send(fp.encode(fp.Route(2, "q", None, fp.PromptKeys([*PROMPT, 1]))))
        assert await sock.poll(int(STEP * 1000))
        assert fp.decode_reply(await sock.recv()) == fp.Routed(2, "q", 1, "prefix")
        sock.close(0)
    finally:
        for agent in agents:
            await asyncio.wait_for(agent.close(linger_s=0.0), STEP)
        for publisher in publishers:
            publisher.close()
        ctx.term()
        assert handle.shutdown(timeout=5.0) == 0, handle.stderr_text()[-3000:]
