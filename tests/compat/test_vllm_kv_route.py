"""vLLM 0.33's own KV event publisher and ready greeting, read by a real coordinator process.

``ZmqEventPublisher`` comes unmodified from the pinned wheel (``tools.vllm_wheel``)
and runs its own publishing thread. Configured as ``tcp://127.0.0.1:PORT`` (a
host, so vLLM's publisher connects and the coordinator binds) with a replay
endpoint (which vLLM's publisher always binds), for DP rank 1 so that every
address goes through the per-rank offset. The coordinator joins after the
publisher has published (a late join: it must catch up by replay), routes by
what vLLM's events say, and notices when a new publisher process starts
counting from 0 again.
"""

from __future__ import annotations

import dataclasses
import socket
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from coordinator.launch import CoordinatorHandle, launch
from coordinator.protocol import frontend as fp
from coordinator.protocol.kv_events import GreetingKV, PublisherSettings, decode_greeting_kv
from tools.vllm_wheel import KV_EVENTS_REAL, WheelUnavailable, vllm_modules

pytestmark = pytest.mark.timeout(90)

STEP = 10.0
BLOCK = 16


@pytest.fixture(scope="module")
def vllm_kv() -> dict[str, types.ModuleType]:
    try:
        with vllm_modules("vllm.distributed.kv_events", "vllm.v1.engine",
                          real=KV_EVENTS_REAL) as mods:
            return mods
    except WheelUnavailable as exc:
        pytest.skip(f"vLLM 0.33.0 wheel unavailable: {exc}")


def free_ports(count: int) -> int:
    """A base port with ``count`` consecutive free ports after it (loopback)."""
    for base in range(41000, 60000, 97):
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


class Coordinator:
    def __init__(self, handle: CoordinatorHandle) -> None:
        self.handle = handle
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(handle.addresses["frontend"])
        self.calls = 0

    def call(self, message: Any) -> fp.FrontendReply:
        self.sock.send(fp.encode(message))
        assert self.sock.poll(int(STEP * 1000)), "no reply"
        return fp.decode_reply(self.sock.recv())

    def counters(self) -> dict[str, int]:
        self.calls += 1
        reply = self.call(fp.QueryState(self.calls))
        assert isinstance(reply, fp.StateReply)
        return dict(reply.state.counters)

    def wait(self, name: str, at_least: int) -> None:
        deadline = time.monotonic() + STEP
        while (value := self.counters().get(name, 0)) < at_least:
            assert time.monotonic() < deadline, f"{name} stayed at {value}"
            time.sleep(0.02)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()
        assert self.handle.shutdown(timeout=5.0) == 0, self.handle.stderr_text()[-3000:]


@pytest.fixture
def ports() -> tuple[int, int]:
    return free_ports(2), free_ports(2) + 200


@pytest.fixture
def coordinator(tmp_path: Path, ports: tuple[int, int]) -> Iterator[Coordinator]:
    live, replay = ports
    handle = launch(engines=2, addr_file=str(tmp_path / "addresses.json"), timeout=20.0,
                    extra_args=["--policy", "prefix",
                                "--kv-events-endpoint", f"tcp://127.0.0.1:{live}",
                                "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}",
                                "--kv-block-size", str(BLOCK)])
    made = Coordinator(handle)
    try:
        yield made
    finally:
        made.close()


def vllm_stored(kv: types.ModuleType, tokens: list[int], first: int,
                parent: int | None) -> Any:
    count = len(tokens) // BLOCK
    return kv.BlockStored(block_hashes=[first + i for i in range(count)],
                          parent_block_hash=parent, token_ids=tokens, block_size=BLOCK,
                          lora_id=None, medium="GPU", lora_name=None)


def test_vllms_publisher_is_followed_caught_up_and_routed_to(
    vllm_kv: dict[str, types.ModuleType], coordinator: Coordinator, ports: tuple[int, int],
) -> None:
    kv = vllm_kv["vllm.distributed.kv_events"]
    live, replay = ports
    prompt = list(range(3000, 3000 + 6 * BLOCK))
    publisher = kv.ZmqEventPublisher(data_parallel_rank=1, endpoint=f"tcp://127.0.0.1:{live}",
                                     replay_endpoint=f"tcp://127.0.0.1:{replay}")
    try:
        assert publisher._endpoint == f"tcp://127.0.0.1:{live + 1}"
        # Three batches chained by parent, published as the engine's scheduler would...
        for index in range(3):
            chunk = prompt[index * 2 * BLOCK:(index + 1) * 2 * BLOCK]
            parent = None if index == 0 else 10 + 2 * index - 1
            publisher.publish(kv.KVEventBatch(ts=time.time(), events=[
                vllm_stored(kv, chunk, 10 + 2 * index, parent)]))
        # ...and more as it goes on serving. Batches published before the coordinator's
        # subscription reached the publisher are lost; the connection's catch-up, or
        # the gap the next batch shows, has them replayed.
        deadline = time.monotonic() + STEP
        extra = 0
        while coordinator.counters().get("prefix_index.stored_blocks", 0) < 6 + extra:
            assert time.monotonic() < deadline, coordinator.counters()
            extra += 1
            publisher.publish(kv.KVEventBatch(ts=time.time(), events=[
                vllm_stored(kv, [extra] * BLOCK, 1000 + extra, None)]))
            time.sleep(0.05)
        counters = coordinator.counters()
        assert counters.get("kv.lost_batches", 0) == 0
        before = coordinator.counters().get("route.cached_tokens", 0)
        reply = coordinator.call(fp.Route(99, "q", None, fp.PromptKeys([*prompt, 1])))
        assert isinstance(reply, fp.Routed) and reply.rank == 1 and reply.reason == "prefix"
        assert coordinator.counters()["route.cached_tokens"] - before == 6 * BLOCK
    finally:
        publisher.shutdown()
    # The engine restarts: a new publisher process counts from 0 again. (ZeroMQ lets go of
    # the old replay port in its own time.)
    deadline = time.monotonic() + STEP
    while True:
        try:
            restarted = kv.ZmqEventPublisher(data_parallel_rank=1,
                                             endpoint=f"tcp://127.0.0.1:{live}",
                                             replay_endpoint=f"tcp://127.0.0.1:{replay}")
            break
        except zmq.ZMQError:
            assert time.monotonic() < deadline, "the old replay port stayed taken"
            time.sleep(0.05)
    try:
        # The old process's connection ended: its rank starts again from scratch.
        coordinator.wait("kv.resets.publisher_disconnected", 1)
        restarted.publish(kv.KVEventBatch(ts=time.time(), events=[
            vllm_stored(kv, [7] * BLOCK, 500, None)]))
        before = coordinator.counters()["route.cached_tokens"]
        reply = coordinator.call(fp.Route(100, "q2", None, fp.PromptKeys([*prompt, 1])))
        assert isinstance(reply, fp.Routed)
        assert coordinator.counters()["route.cached_tokens"] == before  # nothing left to hit
    finally:
        restarted.shutdown()


def test_vllms_ready_greeting_names_the_block_size_and_the_publisher(
    vllm_kv: dict[str, types.ModuleType],
) -> None:
    engine = vllm_kv["vllm.v1.engine"]

    @dataclasses.dataclass
    class KVEventsConfig:  # vllm/config/kv_events.py's fields, in its order
        enable_kv_cache_events: bool = False
        publisher: str = "null"
        endpoint: str = "tcp://*:5557"
        replay_endpoint: str | None = None
        buffer_steps: int = 10_000
        hwm: int = 100_000
        max_queue_size: int = 100_000
        topic: str = ""

    names = [field.name for field in dataclasses.fields(engine.EngineCoreReadyResponse)]
    values: dict[str, Any] = {name: 0 for name in names}
    values.update(dtype="bfloat16", vllm_version="0.33.0", instance_id="i", supports_lora=False,
                  dp_stats_address=None, block_size=32, data_parallel_rank=3,
                  kv_events_config=KVEventsConfig(True, "zmq", "tcp://*:5560",
                                                  "tcp://*:5660", 10_000, 100_000, 100_000,
                                                  "kv"))
    greeting = msgspec.msgpack.encode(engine.EngineCoreReadyResponse(**values))
    assert decode_greeting_kv(greeting) == GreetingKV(
        32, PublisherSettings(True, "zmq", "tcp://*:5560", "tcp://*:5660", "kv"), 3)
    values["kv_events_config"] = None
    assert decode_greeting_kv(msgspec.msgpack.encode(engine.EngineCoreReadyResponse(**values))
                              ) == GreetingKV(32, None, 3)
