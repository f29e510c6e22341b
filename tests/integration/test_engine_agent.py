"""EngineAgent on the wire, against a coordinator scripted from raw zmq sockets.

The scripted side binds what a coordinator binds (handshake ROUTER, dispatch
ROUTER, back-publish XPUB, back-output PULL) plus a frontend's input ROUTER and
output PULL, all on ipc in the test's tmp dir, and checks the exact bytes the
agent sends. It builds its own replies with plain msgpack, not with the
project's codecs, so a codec bug cannot hide on both sides.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from coordinator.engine import (
    FROM_COORDINATOR,
    AbortRequests,
    AddRequest,
    EngineAgent,
    EngineRefused,
    EngineStartupTimeout,
    StartDpWave,
    UtilityCall,
)
from coordinator.frontend import FrontendClient
from coordinator.launch import CoordinatorHandle, launch
from coordinator.protocol.vllm import EngineCoreOutputs
from coordinator.sim import (
    CollectiveHang,
    SimConfig,
    SimEngineGroup,
    SimRequest,
    encode_sim_request,
)

pytestmark = pytest.mark.timeout(30)

RANK = 1
IDENTITY = b"\x01\x00"
STEP = 5.0  # bound on any single wait in these tests
# A unix socket path holds 107 bytes; leave room for the socket names.
MAX_IPC_DIR = 80

# vLLM 0.33's HELLO from a headless, non-local engine, byte for byte.
VLLM_HELLO = bytes.fromhex("83a6737461747573a548454c4c4fa56c6f63616cc2a8686561646c657373c3")

SCHEDULER_STATS_KEYS = [
    "num_running_reqs",
    "num_waiting_reqs",
    "num_skipped_waiting_reqs",
    "num_kv_fetch_reqs_by_stage",
    "step_counter",
    "current_wave",
    "kv_cache_usage",
    "iteration_details",
    "prefix_cache_stats",
    "connector_prefix_cache_stats",
    "kv_cache_eviction_events",
    "spec_decoding_stats",
    "kv_connector_stats",
    "ec_connector_stats",
    "waiting_lora_adapters",
    "running_lora_adapters",
    "cudagraph_stats",
    "perf_stats",
]

READY_RESPONSE_KEYS = [
    "max_model_len",
    "num_gpu_blocks",
    "block_size",
    "dp_stats_address",
    "dtype",
    "vllm_version",
    "world_size",
    "data_parallel_size",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "decode_context_parallel_size",
    "data_parallel_rank",
    "max_num_seqs",
    "max_num_batched_tokens",
    "instance_id",
    "supports_lora",
    "max_loras",
    "mamba_block_size",
    "kv_cache_size_tokens",
    "kv_cache_max_concurrency",
    "kv_events_config",
    "weight_transfer_backend",
    "enable_sleep_mode",
    "supports_draft_weight_updates",
    "effective_attention_block_size",
    "coord_store_port",
    "coordinator_input_address",
    "coordinator_output_address",
]

pack = msgspec.msgpack.encode
unpack = msgspec.msgpack.decode


class ScriptedCoordinator:
    """The coordinator's and one frontend's sockets, driven by the test."""

    def __init__(self, ctx: zmq.asyncio.Context, directory: Path) -> None:
        self.ctx = ctx
        self.addr = {
            name: f"ipc://{directory}/{name}"
            for name in ("hs", "dispatch", "fe_in", "back_pub", "back_out", "fe_out", "front_pub")
        }
        self.handshake = self._bind(zmq.ROUTER, "hs")
        self.dispatch = self._bind(zmq.ROUTER, "dispatch")
        self.frontend_input = self._bind(zmq.ROUTER, "fe_in")
        self.back_publish = self._bind(zmq.XPUB, "back_pub")
        self.back_publish.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.back_output = self._bind(zmq.PULL, "back_out")
        self.frontend_output = self._bind(zmq.PULL, "fe_out")

    def _bind(self, kind: int, name: str) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.addr[name])
        return sock

    def init_payload(self, *, coordinator: bool = True) -> bytes:
        return pack(
            {
                "addresses": {
                    "inputs": [self.addr["dispatch"], self.addr["fe_in"]],
                    "outputs": [self.addr["fe_out"]],
                    "coordinator_input": self.addr["back_pub"] if coordinator else None,
                    "coordinator_output": self.addr["back_out"] if coordinator else None,
                    "frontend_stats_publish_address": self.addr["front_pub"],
                },
                "parallel_config": {
                    "data_parallel_master_ip": "127.0.0.1",
                    "data_parallel_master_port": 29500,
                    "_data_parallel_master_port_list": [29501, 29502],
                    "data_parallel_size": 2,
                },
            }
        )

    async def recv(self, sock: zmq.asyncio.Socket, timeout: float = STEP) -> list[bytes]:
        frames: list[bytes] = await asyncio.wait_for(sock.recv_multipart(), timeout)
        return frames

    async def nothing_on(self, sock: zmq.asyncio.Socket, seconds: float = 0.15) -> bool:
        return not await sock.poll(timeout=int(seconds * 1000))

    async def handshake_until_ready(self) -> dict[str, Any]:
        """Play the coordinator through HELLO..READY; returns the decoded READY map."""
        identity, _hello = await self.recv(self.handshake)
        await self.handshake.send_multipart([identity, self.init_payload()])
        assert await self.recv(self.back_publish) == [b"\x01"]
        await self.recv(self.dispatch)
        await self.recv(self.frontend_input)
        await self.back_publish.send(b"READY")
        identity, ready = await self.recv(self.handshake)
        assert identity == IDENTITY
        decoded: dict[str, Any] = unpack(ready)
        return decoded

    def close(self) -> None:
        for sock in (
            self.handshake,
            self.dispatch,
            self.frontend_input,
            self.back_publish,
            self.back_output,
            self.frontend_output,
        ):
            sock.close(linger=0)


@pytest.fixture
def ipc_dir(tmp_path: Path) -> Iterator[Path]:
    """tmp_path, or a short temp dir when tmp_path is too long for a socket path."""
    if len(str(tmp_path)) <= MAX_IPC_DIR:
        yield tmp_path
        return
    short = Path(tempfile.mkdtemp(prefix="dpa-"))
    try:
        yield short
    finally:
        shutil.rmtree(short, ignore_errors=True)


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
async def peer(ctx: zmq.asyncio.Context, ipc_dir: Path) -> AsyncIterator[ScriptedCoordinator]:
    scripted = ScriptedCoordinator(ctx, ipc_dir)
    yield scripted
    scripted.close()


def make_agent(peer: ScriptedCoordinator, **options: Any) -> EngineAgent:
    options.setdefault("handshake_timeout_s", STEP)
    options.setdefault("ready_timeout_s", STEP)
    options.setdefault("accept_timeout_s", STEP)
    options.setdefault("heartbeat_interval_s", None)
    return EngineAgent(peer.addr["hs"], RANK, **options)


async def started_agent(peer: ScriptedCoordinator, **options: Any) -> EngineAgent:
    agent = make_agent(peer, **options)
    start = asyncio.ensure_future(agent.start())
    await peer.handshake_until_ready()
    if not agent.vllm_shaped:
        identity = IDENTITY
        await peer.handshake.send_multipart([identity, pack({"status": "ACCEPTED"})])
    await asyncio.wait_for(start, STEP)
    return agent


# ---------------------------------------------------------------- handshake bytes


async def test_vllm_shaped_startup_sends_vllms_exact_bytes(peer: ScriptedCoordinator) -> None:
    agent = make_agent(peer, vllm_shaped=True, parallel_config_hash="cfg-hash-1")
    start = asyncio.ensure_future(agent.start())
    try:
        identity, hello = await peer.recv(peer.handshake)
        assert identity == IDENTITY
        assert hello == VLLM_HELLO

        await peer.handshake.send_multipart([identity, peer.init_payload()])

        # Subscription: exactly one frame, b"\x01".
        assert await peer.recv(peer.back_publish) == [b"\x01"]

        # Greeting: one frame on every input socket, from the rank's identity.
        for router in (peer.dispatch, peer.frontend_input):
            who, greeting = await peer.recv(router)
            assert who == IDENTITY
            ready = unpack(greeting)
            assert list(ready) == READY_RESPONSE_KEYS
            assert ready["data_parallel_rank"] == RANK
            assert ready["dp_stats_address"] == peer.addr["front_pub"]
            assert ready["coordinator_input_address"] == peer.addr["back_pub"]
            assert ready["coordinator_output_address"] == peer.addr["back_out"]

        # No READY on the handshake until the coordinator's gate opens.
        assert await peer.nothing_on(peer.handshake)
        assert not start.done()
        await peer.back_publish.send(b"READY")

        identity, ready_msg = await peer.recv(peer.handshake)
        assert identity == IDENTITY
        assert ready_msg == pack(
            {
                "status": "READY",
                "local": False,
                "headless": True,
                "parallel_config_hash": "cfg-hash-1",
            }
        )
        # vLLM engines read no reply to READY; neither does a vllm_shaped agent.
        await asyncio.wait_for(start, STEP)
        assert agent.started
        assert agent.parallel_config["data_parallel_size"] == 2
        assert agent.parallel_config["_data_parallel_master_port_list"] == [29501, 29502]
    finally:
        await agent.close(linger_s=0)


async def test_sdk_hello_adds_engine_id_and_protocol_version_and_waits_for_accepted(
    peer: ScriptedCoordinator,
) -> None:
    agent = make_agent(peer, engine_id="engine-abc", local=True, headless=False)
    start = asyncio.ensure_future(agent.start())
    try:
        identity, hello = await peer.recv(peer.handshake)
        assert unpack(hello) == {
            "status": "HELLO",
            "local": True,
            "headless": False,
            "engine_id": "engine-abc",
            "protocol_version": 1,
        }
        # The three vLLM keys come first, in vLLM's order.
        assert list(unpack(hello))[:3] == ["status", "local", "headless"]
        await peer.handshake.send_multipart([identity, peer.init_payload()])
        assert await peer.recv(peer.back_publish) == [b"\x01"]
        await peer.recv(peer.dispatch)
        await peer.recv(peer.frontend_input)
        await peer.back_publish.send(b"READY")
        _, ready = await peer.recv(peer.handshake)
        # No hash configured: no hash key.
        assert unpack(ready) == {"status": "READY", "local": True, "headless": False}
        await asyncio.sleep(0.1)
        assert not start.done(), "an SDK agent waits for the reply to READY"
        await peer.handshake.send_multipart([identity, pack({"status": "ACCEPTED"})])
        await asyncio.wait_for(start, STEP)
    finally:
        await agent.close(linger_s=0)


async def test_a_default_engine_id_is_fresh_per_agent(peer: ScriptedCoordinator) -> None:
    first = make_agent(peer)
    second = make_agent(peer)
    assert first.engine_id and second.engine_id and first.engine_id != second.engine_id
    assert make_agent(peer, vllm_shaped=True).engine_id is None


async def test_refused_hello_raises_with_the_coordinators_reason(
    peer: ScriptedCoordinator,
) -> None:
    agent = make_agent(peer)
    start = asyncio.ensure_future(agent.start())
    identity, _ = await peer.recv(peer.handshake)
    reason = "Engine ID mismatch for dp_rank=1: expected a, got b. Stop the other engine."
    await peer.handshake.send_multipart([identity, pack({"status": "ERROR", "reason": reason})])
    with pytest.raises(EngineRefused) as caught:
        await asyncio.wait_for(start, STEP)
    assert caught.value.reason == reason
    assert caught.value.stage == "HELLO"
    assert reason in str(caught.value)


async def test_refused_ready_raises(peer: ScriptedCoordinator) -> None:
    agent = make_agent(peer, parallel_config_hash="other")
    start = asyncio.ensure_future(agent.start())
    ready = await peer.handshake_until_ready()
    assert ready["parallel_config_hash"] == "other"
    reason = "parallel_config_hash mismatch"
    await peer.handshake.send_multipart([IDENTITY, pack({"status": "ERROR", "reason": reason})])
    with pytest.raises(EngineRefused) as caught:
        await asyncio.wait_for(start, STEP)
    assert (caught.value.reason, caught.value.stage) == (reason, "READY")


async def test_no_ready_gate_is_a_clear_timeout(peer: ScriptedCoordinator) -> None:
    agent = make_agent(peer, ready_timeout_s=0.3)
    start = asyncio.ensure_future(agent.start())
    identity, _ = await peer.recv(peer.handshake)
    began = time.monotonic()
    await peer.handshake.send_multipart([identity, peer.init_payload()])
    with pytest.raises(EngineStartupTimeout) as caught:
        await asyncio.wait_for(start, STEP)
    assert 0.25 < time.monotonic() - began < 2.0
    assert caught.value.stage == "coordinator_ready"
    message = str(caught.value)
    assert peer.addr["back_pub"] in message and "all 2 ranks" in message
    # The agent never claimed READY on the handshake.
    assert await peer.nothing_on(peer.handshake)


async def test_no_init_reply_is_a_clear_timeout(peer: ScriptedCoordinator) -> None:
    agent = make_agent(peer, handshake_timeout_s=0.2)
    with pytest.raises(EngineStartupTimeout) as caught:
        await asyncio.wait_for(agent.start(), STEP)
    assert caught.value.stage == "init"
    assert peer.addr["hs"] in str(caught.value)


async def test_no_accepted_reply_is_a_clear_timeout(peer: ScriptedCoordinator) -> None:
    agent = make_agent(peer, accept_timeout_s=0.2)
    start = asyncio.ensure_future(agent.start())
    await peer.handshake_until_ready()
    with pytest.raises(EngineStartupTimeout) as caught:
        await asyncio.wait_for(start, STEP)
    assert caught.value.stage == "accept"


async def test_a_wave_broadcast_overtaking_ready_is_kept(peer: ScriptedCoordinator) -> None:
    agent = make_agent(peer, vllm_shaped=True)
    start = asyncio.ensure_future(agent.start())
    try:
        identity, _ = await peer.recv(peer.handshake)
        await peer.handshake.send_multipart([identity, peer.init_payload()])
        assert await peer.recv(peer.back_publish) == [b"\x01"]
        await peer.back_publish.send_multipart([b"\x02", pack([3, 0])])
        await peer.back_publish.send(b"READY")
        await peer.recv(peer.handshake)
        await asyncio.wait_for(start, STEP)
        request = await agent.recv_request(timeout_s=STEP)
        assert request == StartDpWave(
            wave=3, exclude=0, source=FROM_COORDINATOR, frames=(pack([3, 0]),)
        )
    finally:
        await agent.close(linger_s=0)


async def test_without_a_coordinator_there_is_no_gate_and_no_wave_traffic(
    peer: ScriptedCoordinator,
) -> None:
    agent = make_agent(peer, vllm_shaped=True)
    start = asyncio.ensure_future(agent.start())
    try:
        identity, _ = await peer.recv(peer.handshake)
        await peer.handshake.send_multipart([identity, peer.init_payload(coordinator=False)])
        await peer.recv(peer.dispatch)
        await peer.handshake.recv_multipart()
        await asyncio.wait_for(start, STEP)
        assert not agent.has_coordinator
        with pytest.raises(RuntimeError, match="no coordinator output"):
            agent.send_start_wave(1)
    finally:
        await agent.close(linger_s=0)


# ---------------------------------------------------------------- outbound bytes


async def test_outbound_messages_are_vllm_shaped(peer: ScriptedCoordinator) -> None:
    agent = await started_agent(peer)
    try:
        agent.send_stats(waiting=5, running=2, kv_cache_usage=0.25, step_counter=17, current_wave=4)
        (frame,) = await peer.recv(peer.back_output)
        message = unpack(frame)
        assert len(message) == 9
        assert message[0] == RANK and message[1] == []
        stats = message[2]
        assert list(stats) == SCHEDULER_STATS_KEYS
        assert (stats["num_running_reqs"], stats["num_waiting_reqs"]) == (2, 5)
        assert (stats["step_counter"], stats["current_wave"]) == (17, 4)
        assert stats["kv_cache_usage"] == 0.25
        assert message[3] > 0 and isinstance(message[3], float)
        assert message[4:] == [None, None, None, None, None]
        # kv_cache_usage travels as float64, like vLLM's.
        assert b"\xae" + b"kv_cache_usage" + b"\xcb" in frame

        agent.send_start_wave(8)
        (frame,) = await peer.recv(peer.back_output)
        assert frame[:3] == b"\x99\x01\x90" and frame[3:5] == b"\xc0\xcb"
        assert frame[13:] == b"\xc0\xc0\xc0\x08\xc0"

        agent.send_wave_complete(7)
        (frame,) = await peer.recv(peer.back_output)
        assert frame[13:] == b"\xc0\xc0\x07\xc0\xc0"

        agent.send_heartbeat()
        (frame,) = await peer.recv(peer.back_output)
        assert unpack(frame)[:3] == [RANK, [], None]
        assert frame[13:] == b"\xc0" * 5

        agent.send_output(0, EngineCoreOutputs(finished_requests=["r1", "r2"]))
        (frame,) = await peer.recv(peer.frontend_output)
        message = unpack(frame)
        assert message[0] == RANK and message[5] == ["r1", "r2"]

        with pytest.raises(IndexError):
            agent.send_output(1, EngineCoreOutputs())

        agent.send_engine_dead()
        assert await peer.recv(peer.frontend_output) == [b"ENGINE_CORE_DEAD"]
        assert await peer.nothing_on(peer.back_output)
    finally:
        await agent.close(linger_s=0)


async def test_heartbeats_fill_coordinator_silence_only(peer: ScriptedCoordinator) -> None:
    agent = await started_agent(peer, heartbeat_interval_s=0.2)
    try:
        began = time.monotonic()
        (frame,) = await peer.recv(peer.back_output, timeout=2.0)
        assert 0.1 < time.monotonic() - began < 1.0
        assert unpack(frame)[:3] == [RANK, [], None] and frame[13:] == b"\xc0" * 5

        # Steady traffic keeps heartbeats away.
        for _ in range(6):
            agent.send_stats(waiting=1, running=1, kv_cache_usage=0.0)
            (frame,) = await peer.recv(peer.back_output)
            assert unpack(frame)[2] is not None
            await asyncio.sleep(0.07)
        assert agent.heartbeats_sent == 1

        agent.heartbeats_enabled = False
        assert await peer.nothing_on(peer.back_output, seconds=0.5)
    finally:
        await agent.close(linger_s=0)


# ---------------------------------------------------------------- inbound requests


async def test_requests_are_decoded_and_junk_is_dropped(peer: ScriptedCoordinator) -> None:
    agent = await started_agent(peer)
    try:
        d = peer.dispatch
        await peer.back_publish.send_multipart([b"\x02", pack([4, 0])])
        request = await agent.recv_request(timeout_s=STEP)
        assert isinstance(request, StartDpWave)
        assert (request.wave, request.exclude, request.source) == (4, 0, FROM_COORDINATOR)

        await d.send_multipart([IDENTITY, b"\x02", pack([5, None])])
        request = await agent.recv_request(timeout_s=STEP)
        assert isinstance(request, StartDpWave)
        assert (request.wave, request.exclude, request.source) == (5, None, 0)

        await d.send_multipart([IDENTITY, b"\x00", b"opaque-1", b"opaque-2"])
        request = await agent.recv_request(timeout_s=STEP)
        assert request == AddRequest(source=0, frames=(b"opaque-1", b"opaque-2"))

        await peer.frontend_input.send_multipart([IDENTITY, b"\x01", pack(["a", "b"])])
        request = await agent.recv_request(timeout_s=STEP)
        assert isinstance(request, AbortRequests)
        assert (request.request_ids, request.source) == (["a", "b"], 1)

        await d.send_multipart([IDENTITY, b"\x03", pack([0, 7, "is_sleeping", []])])
        request = await agent.recv_request(timeout_s=STEP)
        assert isinstance(request, UtilityCall)
        assert (request.client_index, request.call_id, request.method, request.args) == (
            0,
            7,
            "is_sleeping",
            [],
        )

        # Junk of every kind; then one good message proves the agent kept reading.
        await peer.back_publish.send(b"READY")
        await d.send_multipart([IDENTITY, b"READY"])
        await d.send_multipart([IDENTITY, b"\x09", b"whatever"])
        await d.send_multipart([IDENTITY, b"\x04"])
        await d.send_multipart([IDENTITY, b"\x01", b"\xc1"])
        await d.send_multipart([IDENTITY, b"\x02", pack(["not", "a wave"])])
        await d.send_multipart([IDENTITY, b"\x02", pack([1, 0]), b"extra"])
        await d.send_multipart([IDENTITY, b"\x00"])
        await d.send_multipart([IDENTITY, b"\x03", pack([0, 1, "too short"])])
        await peer.back_publish.send_multipart([b"\x02", pack([-1, 0])])
        await d.send_multipart([IDENTITY, b"\x00", b"good"])
        request = await agent.recv_request(timeout_s=STEP)
        assert request == AddRequest(source=0, frames=(b"good",))
        assert agent.get_request_nowait() is None
        assert sum(agent.drops.values()) == 8
        assert agent.drops["unexpected_type"] == 2
        assert agent.drops["frame_count"] == 2
    finally:
        await agent.close(linger_s=0)


async def test_recv_request_times_out(peer: ScriptedCoordinator) -> None:
    agent = await started_agent(peer)
    try:
        with pytest.raises(asyncio.TimeoutError):
            await agent.recv_request(timeout_s=0.05)
    finally:
        await agent.close(linger_s=0)


# ---------------------------------------------------------------- other event loops


def run_with_loop(
    factory: Callable[[], asyncio.AbstractEventLoop], main: Coroutine[Any, Any, None]
) -> None:
    loop = factory()
    try:
        loop.run_until_complete(asyncio.wait_for(main, 20))
    finally:
        loop.close()


async def _full_exchange(directory: Path) -> None:
    ctx = zmq.asyncio.Context()
    peer = ScriptedCoordinator(ctx, directory)
    try:
        agent = await started_agent(peer, heartbeat_interval_s=0.1)
        try:
            await peer.dispatch.send_multipart([IDENTITY, b"\x00", b"p"])
            assert await agent.recv_request(timeout_s=STEP) == AddRequest(source=0, frames=(b"p",))
            agent.send_start_wave(0)
            (frame,) = await peer.recv(peer.back_output)
            assert unpack(frame)[7] == 0
            (frame,) = await peer.recv(peer.back_output)  # a heartbeat
            assert frame[13:] == b"\xc0" * 5
        finally:
            await agent.close(linger_s=0)
    finally:
        peer.close()
        ctx.destroy(linger=0)


@pytest.mark.parametrize("loop_name", ["asyncio", "uvloop"])
def test_agent_runs_on_both_event_loops(loop_name: str, ipc_dir: Path) -> None:
    if loop_name == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    else:
        factory = asyncio.new_event_loop
    run_with_loop(factory, _full_exchange(ipc_dir))


# ---------------------------------------------------------------- against the real coordinator
# A coordinator process (`python -m coordinator serve`), one frontend (the SDK)
# and simulated engines built on the agent.


@pytest.fixture
def coordinator_process() -> Iterator[CoordinatorHandle]:
    handle = launch(engines=2, frontends=1, timeout=20.0)
    try:
        yield handle
    finally:
        handle.shutdown(timeout=5.0)


def sim_config(**overrides: Any) -> SimConfig:
    options: dict[str, Any] = {
        "step_time_s": 0.002,
        "dp_sync_interval": 4,
        "collective_timeout_s": 3.0,
        "handshake_timeout_s": STEP,
        "ready_timeout_s": 10.0,
        "accept_timeout_s": STEP,
    }
    options.update(overrides)
    return SimConfig(**options)


def sim_payload(client: FrontendClient, request_id: str, steps: int) -> list[bytes]:
    request = SimRequest(request_id, client.client_index, client.wave, steps, time.monotonic_ns())
    return [encode_sim_request(request)]


async def running_group(
    coordinator_process: CoordinatorHandle, **overrides: Any
) -> tuple[FrontendClient, SimEngineGroup]:
    client = FrontendClient(coordinator_process.addresses, client_index=0, call_timeout_s=STEP)
    # INIT waits for the one expected frontend, so it registers first.
    await client.register()
    group = SimEngineGroup(
        coordinator_process.addresses["handshake"], 2, config=sim_config(**overrides)
    )
    await asyncio.wait_for(group.start(), 15.0)
    # A vllm-shaped engine does not wait for ACCEPTED, so its start() can return
    # before the coordinator has read its READY.
    await wait_for_ready_ranks(client, 2)
    return client, group


async def wait_for_ready_ranks(client: FrontendClient, count: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while sum(e.state == "ready" for e in (await client.query_state()).engines) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"fewer than {count} ranks became ready")
        await asyncio.sleep(0.02)


async def finished_ids(client: FrontendClient, count: int, timeout: float = STEP) -> list[str]:
    """The next `count` finished request ids; fails if they do not all come."""
    ids: list[str] = []
    async for finished in client.finished(idle_timeout=timeout):
        ids.append(finished.request_id)
        if len(ids) == count:
            return ids
    raise AssertionError(f"only {ids} finished; expected {count} requests")


async def wait_until(predicate: Callable[[], bool], timeout: float = STEP) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("vllm_shaped", [False, True], ids=["sdk", "vllm-shaped"])
async def test_sim_group_serves_requests_in_lockstep(
    coordinator_process: CoordinatorHandle, vllm_shaped: bool
) -> None:
    client, group = await running_group(coordinator_process, vllm_shaped=vllm_shaped)
    try:
        e0, e1 = group.engines
        # The first request goes to rank 1 while the group is paused: rank 0 gets
        # no request and must be woken, or rank 1 would hang in the collective.
        ids = ["first"]
        await client.submit("first", sim_payload(client, "first", 10), dp_rank=1)
        for i in range(30):
            request_id = f"r{i}"
            ids.append(request_id)
            await client.submit(request_id, sim_payload(client, request_id, 3 + i % 9))
        assert sorted(await finished_ids(client, len(ids))) == sorted(ids)

        await wait_until(lambda: not e0.engines_running and not e1.engines_running)
        assert group.hangs == []
        assert e0.counters.wakes_applied[:1] == [0]
        assert e1.counters.start_waves_sent[:1] == [0]
        # Rank 0 was woken without a request of its own: it mirrors the edge.
        assert e0.counters.start_waves_sent[:1] == [0]
        assert e0.counters.wave_completes_sent and not e1.counters.wave_completes_sent
        # Lockstep: both ranks met in every collective and ended in the same wave.
        assert e0.counters.collectives == e1.counters.collectives > 0
        assert e0.current_wave == e1.current_wave >= 1
        assert e0.counters.finished + e1.counters.finished == len(ids)
        assert e0.counters.finished > 0 and e1.counters.finished > 0
        await client.wait_for(lambda c: c.wave == e0.current_wave and not c.running)
    finally:
        await group.stop()
        await client.close()


async def test_a_peer_that_ignores_the_wake_is_a_detected_hang(
    coordinator_process: CoordinatorHandle,
) -> None:
    client, group = await running_group(coordinator_process, collective_timeout_s=0.5)
    try:
        e0, e1 = group.engines
        e0.ignore_start_wave = True
        began = time.monotonic()
        await client.submit("stuck", sim_payload(client, "stuck", 5), dp_rank=1)
        await asyncio.wait_for(e1.done.wait(), STEP)
        assert 0.5 <= time.monotonic() - began < 3.0
        (hang,) = e1.hangs
        assert (hang.rank, hang.missing, hang.arrived) == (1, (0,), (1,))
        assert isinstance(e1.failed, CollectiveHang)
        assert e0.hangs == [] and e0.counters.collectives == 0
        # A dead engine tells its frontends, as vLLM's does.
        await wait_until(lambda: client.stats["notice.EngineDead"] >= 1)
    finally:
        await group.stop()
        await client.close()


async def test_a_frozen_peer_blocks_the_group_until_it_thaws(
    coordinator_process: CoordinatorHandle,
) -> None:
    client, group = await running_group(
        coordinator_process, collective_timeout_s=0.3, on_hang="wait"
    )
    try:
        e0, e1 = group.engines
        await client.submit("long", sim_payload(client, "long", 200), dp_rank=1)
        await wait_until(lambda: e0.counters.dummy_steps > 2)
        e0.freeze()
        await wait_until(lambda: len(e1.hangs) >= 2)
        assert all(h.missing == (0,) for h in e1.hangs)
        assert e1.hangs[1].waited_s > e1.hangs[0].waited_s
        e0.unfreeze()
        assert await finished_ids(client, 1) == ["long"]
        assert e1.failed is None and e0.hangs == []
    finally:
        await group.stop()
        await client.close()


async def test_an_abort_ends_the_request_and_then_the_wave(
    coordinator_process: CoordinatorHandle,
) -> None:
    client, group = await running_group(coordinator_process)
    try:
        e0, e1 = group.engines
        await client.submit("endless", sim_payload(client, "endless", 10_000_000), dp_rank=1)
        await wait_until(lambda: e1.num_running == 1 and e0.engines_running)
        assert await client.abort(["endless"]) == ["endless"]
        assert await finished_ids(client, 1) == ["endless"]
        assert e1.counters.aborted == 1 and e1.counters.finished == 0
        await wait_until(lambda: e0.current_wave == e1.current_wave == 1)
        assert e0.counters.wave_completes_sent == [0]
        assert group.hangs == []
    finally:
        await group.stop()
        await client.close()


async def test_a_refused_rank_stops_its_group_at_once(
    coordinator_process: CoordinatorHandle,
) -> None:
    client = FrontendClient(coordinator_process.addresses, client_index=0, call_timeout_s=STEP)
    await client.register()
    # Ranks 1 and 2 against a coordinator for ranks 0..1: rank 2 is refused, and
    # rank 1 alone could never pass the READY gate, so it must not be left waiting.
    group = SimEngineGroup(
        coordinator_process.addresses["handshake"],
        2,
        config=sim_config(rank_start=1, ready_timeout_s=60.0),
    )
    began = time.monotonic()
    try:
        with pytest.raises(EngineRefused) as caught:
            await asyncio.wait_for(group.start(), 15.0)
        assert time.monotonic() - began < STEP
        assert "dp_rank=2" in caught.value.reason
        assert all(engine.done.is_set() for engine in group.engines)
    finally:
        await group.stop()
        await client.close()


async def test_dense_sim_engines_report_loads_without_waves() -> None:
    handle = launch(engines=2, frontends=1, lockstep=False, timeout=20.0)
    try:
        client, group = await running_group(handle, lockstep=False)
        try:
            ids = [f"d{i}" for i in range(12)]
            for request_id in ids:
                await client.submit(request_id, sim_payload(client, request_id, 4))
            assert sorted(await finished_ids(client, len(ids))) == sorted(ids)
            for engine in group.engines:
                assert engine.counters.collectives == engine.counters.dummy_steps == 0
                assert engine.counters.start_waves_sent == []
                assert engine.counters.wave_completes_sent == []
                assert engine.current_wave == 0
                assert engine.counters.finished > 0
            assert client.wave == 0 and not client.running
        finally:
            await group.stop()
            await client.close()
    finally:
        handle.shutdown(timeout=5.0)


# ---------------------------------------------------------------- the command line


def sim_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "coordinator.sim", *args]


def test_sim_help_explains_the_commands() -> None:
    out = subprocess.run(
        sim_command("--help"), capture_output=True, text=True, timeout=30, check=True
    ).stdout
    for word in ("group", "engine", "hub", "collective hang"):
        assert word in out
    out = subprocess.run(
        sim_command("engine", "--help"), capture_output=True, text=True, timeout=30, check=True
    ).stdout
    for option in ("--rank", "--addr-file", "--collective", "--on-hang", "--ignore-start-wave"):
        assert option in out


async def test_engine_processes_and_a_killed_peer(
    coordinator_process: CoordinatorHandle, ipc_dir: Path
) -> None:
    """Separate hub and engine processes; kill -9 one mid-wave, the other reports the hang."""
    client = FrontendClient(coordinator_process.addresses, client_index=0, call_timeout_s=STEP)
    await client.register()
    hub_address = f"ipc://{ipc_dir}/hub"
    common = [
        "--engines",
        "2",
        "--addr-file",
        coordinator_process.addr_file,
        "--step-ms",
        "2",
        "--collective",
        hub_address,
        "--collective-timeout",
        "0.5",
        "--loop",
        "asyncio",
    ]
    hub = subprocess.Popen(
        sim_command("hub", "--engines", "2", "--bind", hub_address),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    engines = [
        subprocess.Popen(
            sim_command("engine", "--rank", str(rank), *common),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for rank in (0, 1)
    ]
    try:
        await wait_for_ready_ranks(client, 2)
        assert all(p.poll() is None for p in engines), "an engine process exited"
        await client.submit("ok", sim_payload(client, "ok", 5))
        assert await finished_ids(client, 1, timeout=15.0) == ["ok"]
        await client.submit("long", sim_payload(client, "long", 100_000), dp_rank=1)
        await wait_until(lambda: client.running)
        engines[0].kill()
        engines[0].wait(timeout=STEP)
        out, err = engines[1].communicate(timeout=15.0)
        assert engines[1].returncode == 3, err.decode(errors="replace")[-2000:]
        summary = json.loads(out.decode().strip().splitlines()[-1])
        assert summary["rank"] == 1
        assert summary["hangs"] and "missing ranks [0]" in summary["hangs"][0]
        assert b"COLLECTIVE HANG" in err
    finally:
        for process in (*engines, hub):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for rank, process in enumerate((*engines, hub)):
            try:
                _, err = process.communicate(timeout=STEP)
            except subprocess.TimeoutExpired:
                process.kill()
                _, err = process.communicate()
            if err:  # shown only when the test fails
                print(f"--- stderr of {'hub' if process is hub else f'engine {rank}'}:\n"
                      f"{err.decode(errors='replace')[-3000:]}")
        await client.close()
    assert hub.returncode == 0
