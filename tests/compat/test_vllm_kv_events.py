"""vLLM 0.33's own KV event code against this project's decoders and endpoint rule.

vLLM's unmodified `vllm/distributed/kv_events.py` comes from the pinned wheel
(through `tools/vllm_wheel.py`); only its imports of vLLM's config, logger,
network helpers and the block-hash type alias are replaced. Its event
structs produce the bytes, and its `ZmqEventPublisher` runs for real on
loopback TCP, publishing and replaying, for DP rank 3 so that every address
goes through the per-rank port offset.
"""

from __future__ import annotations

import socket
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVSubscription,
    ReplayBatch,
    ReplayEnd,
    decode_kv_batch,
    decode_kv_frames,
    decode_replay_frames,
    encode_kv_batch,
    encode_replay_request,
    offset_endpoint,
    subscription_for,
)
from tests.compat.vllm_stand_ins import KV_STAND_INS
from tools import vllm_wheel

RANK = 3
WAIT_S = 10.0


@pytest.fixture(scope="module")
def vllm_kv() -> types.ModuleType:
    try:
        modules = vllm_wheel.load("vllm.distributed.kv_events", stand_ins=KV_STAND_INS)
    except vllm_wheel.WheelUnavailable as exc:
        pytest.skip(f"vLLM {vllm_wheel.VLLM_VERSION} wheel unavailable: {exc}")
    return modules["vllm.distributed.kv_events"]


def vllm_batch(kv: types.ModuleType, batch: KVEventBatch) -> Any:
    """The same batch built from vLLM's own event classes."""
    events: list[Any] = []
    for event in batch.events:
        fields = msgspec.structs.asdict(event)
        events.append(getattr(kv, type(event).__name__)(**fields))
    return kv.KVEventBatch(
        ts=batch.ts, events=events, data_parallel_rank=batch.data_parallel_rank
    )


block_hashes = st.one_of(st.binary(min_size=32, max_size=32), st.integers(0, (1 << 64) - 1))
stored = st.builds(
    BlockStored,
    block_hashes=st.lists(block_hashes, min_size=1, max_size=4),
    parent_block_hash=st.none() | block_hashes,
    token_ids=st.lists(st.integers(0, 200_000), max_size=64),
    block_size=st.sampled_from([1, 4, 16]),
    lora_id=st.none() | st.integers(1, 9),
    medium=st.sampled_from([None, "GPU", "CPU"]),
    lora_name=st.none() | st.sampled_from(["adapter-a", "adapter-b"]),
    extra_keys=st.none()
    | st.lists(
        st.none() | st.lists(st.one_of(st.just("adapter-a"), st.just(["mm", 3])), max_size=2),
        max_size=4,
    ),
    group_idx=st.none() | st.integers(0, 3),
    session_id=st.none() | st.just("chat-1"),
    lookahead_token_ids=st.none() | st.lists(st.lists(st.integers(0, 99), max_size=2), max_size=2),
)
removed = st.builds(
    BlockRemoved,
    block_hashes=st.lists(block_hashes, min_size=1, max_size=4),
    medium=st.sampled_from([None, "GPU"]),
    group_idx=st.none() | st.integers(0, 3),
)
batches = st.builds(
    KVEventBatch,
    ts=st.floats(0, 2e9),
    events=st.lists(st.one_of(stored, removed, st.just(AllBlocksCleared())), max_size=5),
    data_parallel_rank=st.none() | st.integers(0, 64),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches)
def test_vllm_encoded_batches_decode_and_encode_back_byte_for_byte(
    vllm_kv: types.ModuleType, batch: KVEventBatch
) -> None:
    vllm_bytes = msgspec.msgpack.encode(vllm_batch(vllm_kv, batch))
    decoded = decode_kv_batch(vllm_bytes)
    assert decoded.unknown_events == 0
    assert decoded.batch == batch
    assert encode_kv_batch(decoded.batch) == vllm_bytes


endpoints = st.one_of(
    st.builds(
        lambda host, port: f"tcp://{host}:{port}",
        st.sampled_from(["*", "127.0.0.1", "[::1]", "[::]", "0.0.0.0", "engine-2"]),
        st.integers(0, 70_000).map(str) | st.sampled_from(["", "x", "-5", "+7", " 9"]),
    ),
    st.sampled_from(["inproc://cache", "ipc:///tmp/kv", "tcp://host", "udp://*:1", ""]),
    st.text(max_size=16),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(endpoint=endpoints, rank=st.integers(0, 300))
def test_the_port_offset_rule_is_vllms(
    vllm_kv: types.ModuleType, endpoint: str, rank: int
) -> None:
    try:
        expected: str | None = vllm_kv.ZmqEventPublisher.offset_endpoint_port(endpoint, rank)
    except ValueError:
        expected = None
    if expected is None:
        with pytest.raises(ValueError):
            offset_endpoint(endpoint, rank)
    else:
        assert offset_endpoint(endpoint, rank) == expected


# --- vLLM's publisher, running --------------------------------------------------------


@dataclass
class Running:
    publisher: Any
    live: zmq.Socket[bytes]
    replay_address: str


def _free_port() -> int:
    # A plain socket closes at once; a ZMQ socket closes later, in ZMQ's I/O
    # thread, and could still hold the port when the publisher binds it.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


@pytest.fixture
def running(
    vllm_kv: types.ModuleType, zmq_ctx: zmq.Context[zmq.Socket[bytes]]
) -> Iterator[Running]:
    # A non-wildcard live endpoint makes vLLM's publisher connect, so the
    # subscriber binds first; the replay endpoint is always bound by the publisher.
    live = zmq_ctx.socket(zmq.SUB)
    live.setsockopt(zmq.SUBSCRIBE, b"")
    live_port = live.bind_to_random_port("tcp://127.0.0.1", min_port=20_000, max_port=60_000)
    live_endpoint = f"tcp://127.0.0.1:{live_port - RANK}"
    assert subscription_for(live_endpoint, RANK) == KVSubscription(
        f"tcp://127.0.0.1:{live_port}", True
    )
    publisher = None
    for _ in range(5):  # another process may take the probed port first
        replay_port = _free_port()
        replay_endpoint = f"tcp://127.0.0.1:{replay_port - RANK}"
        try:
            publisher = vllm_kv.ZmqEventPublisher(
                data_parallel_rank=RANK,
                endpoint=live_endpoint,
                replay_endpoint=replay_endpoint,
                buffer_steps=100,
                topic="kv",
            )
            break
        except zmq.ZMQError:
            continue
    assert publisher is not None, "no free port for vLLM's replay socket"
    replay = subscription_for(replay_endpoint, RANK, replay=True)
    assert replay == KVSubscription(f"tcp://127.0.0.1:{replay_port}", False)
    try:
        yield Running(publisher, live, replay.address)
    finally:
        publisher.shutdown()


def _recv(sock: zmq.Socket[bytes], timeout_s: float) -> list[bytes] | None:
    if sock.poll(int(timeout_s * 1000)):
        return sock.recv_multipart()
    return None


def test_vllm_publisher_stream_and_replay_decode(
    vllm_kv: types.ModuleType, running: Running, zmq_ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    kv = vllm_kv
    # A PUB drops what it sends before the subscription arrives: publish
    # markers until one gets through, then the batches under test.
    deadline = time.monotonic() + WAIT_S
    first: list[bytes] | None = None
    published = 0
    while first is None:
        assert time.monotonic() < deadline, "vLLM's publisher never reached the subscriber"
        running.publisher.publish(kv.KVEventBatch(ts=time.time(), events=[kv.AllBlocksCleared()]))
        published += 1
        first = _recv(running.live, 0.1)
    message = decode_kv_frames(first)
    assert message.topic == b"kv"
    assert message.batch.data_parallel_rank == RANK  # filled in by vLLM's publisher
    assert message.batch.events == [AllBlocksCleared()]

    sent = [
        kv.KVEventBatch(
            ts=1.0,
            events=[
                kv.BlockStored(
                    block_hashes=[b"\x11" * 32, b"\x22" * 32],
                    parent_block_hash=None,
                    token_ids=list(range(8)),
                    block_size=4,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                    group_idx=0,
                )
            ],
        ),
        kv.KVEventBatch(
            ts=2.0,
            events=[
                kv.BlockStored(
                    block_hashes=[7],
                    parent_block_hash=b"\x22" * 32,
                    token_ids=[8, 9, 10, 11],
                    block_size=4,
                    lora_id=1,
                    medium="GPU",
                    lora_name="adapter",
                    extra_keys=[("adapter", ("mm-1", 2), "salt")],
                    group_idx=0,
                    session_id="chat-9",
                ),
                kv.BlockRemoved(block_hashes=[b"\x11" * 32], medium="GPU", group_idx=0),
            ],
        ),
    ]
    for batch in sent:
        running.publisher.publish(batch)
    received = []
    last_seq = message.seq
    while len(received) < len(sent):
        frames = _recv(running.live, WAIT_S)
        assert frames is not None, "a published batch did not arrive"
        live = decode_kv_frames(frames)
        if live.batch.events == [AllBlocksCleared()]:
            last_seq = live.seq  # a late marker
            continue
        assert live.seq == last_seq + 1
        last_seq = live.seq
        received.append(live.batch)
    stored_first, stored_second = received[0].events[0], received[1].events[0]
    assert isinstance(stored_first, BlockStored) and isinstance(stored_second, BlockStored)
    assert stored_first.block_hashes == [b"\x11" * 32, b"\x22" * 32]
    assert stored_second.parent_block_hash == b"\x22" * 32
    assert stored_second.extra_keys == [["adapter", ["mm-1", 2], "salt"]]
    assert stored_second.session_id == "chat-9"
    assert received[1].events[1] == BlockRemoved([b"\x11" * 32], "GPU", group_idx=0)
    assert all(batch.data_parallel_rank == RANK for batch in received)

    # Replay from the start, then from the middle: every buffered batch in
    # order, then the end marker.
    dealer = zmq_ctx.socket(zmq.DEALER)
    dealer.connect(running.replay_address)
    for start in (0, last_seq - 1):
        dealer.send_multipart(encode_replay_request(start))
        replayed: list[ReplayBatch] = []
        while True:
            frames = _recv(dealer, WAIT_S)
            assert frames is not None, "vLLM's replay did not answer"
            reply = decode_replay_frames(frames)
            if isinstance(reply, ReplayEnd):
                break
            replayed.append(reply)
        assert [reply.seq for reply in replayed] == list(range(start, last_seq + 1))
        assert all(reply.topic == b"kv" for reply in replayed)
        assert [reply.batch for reply in replayed[-2:]] == received
