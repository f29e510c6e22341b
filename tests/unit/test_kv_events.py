"""vLLM 0.33 KV events: batches, frames, replay and endpoint rules.

Expected bytes are built here from plain dicts and lists laid out the way
vLLM 0.33 lays them out (event maps tagged by "type", fields in declaration
order, defaults left out), or are literal bytes captured from vLLM's own
publisher code, never with the codecs under test.
"""

from __future__ import annotations

import contextlib
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.protocol.errors import ProtocolError
from coordinator.protocol.kv_events import (
    END_SEQ,
    MAX_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    GreetingKV,
    KVEventBatch,
    KVSubscription,
    PublisherSettings,
    ReplayBatch,
    ReplayEnd,
    decode_greeting_kv,
    decode_kv_batch,
    decode_kv_frames,
    decode_replay_frames,
    decode_replay_request,
    decode_seq,
    encode_kv_batch,
    encode_kv_frames,
    encode_replay_batch,
    encode_replay_end,
    encode_replay_request,
    encode_seq,
    offset_endpoint,
    publisher_binds,
    subscription_for,
)

pack = msgspec.msgpack.encode
unpack = msgspec.msgpack.decode

HASH_A = bytes(range(32))
HASH_B = bytes(range(1, 33))

# What vLLM 0.33's `KVEventBatch(ts=1.5, events=[BlockStored(block_hashes=[b"\x01" * 32, 7],
# parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=2, lora_id=None, medium="GPU",
# lora_name=None, group_idx=0), BlockRemoved(block_hashes=[5], medium="GPU"),
# AllBlocksCleared()], data_parallel_rank=3)` encodes to with msgspec, captured from its
# unmodified kv_events.py. BlockStored has 16 keys with its tag, so msgspec writes a map16
# header for it (0xde 0x00 0x09) even when fewer keys are present.
VLLM_BATCH_BYTES = (
    b"\x93\xcb?\xf8\x00\x00\x00\x00\x00\x00\x93"
    b"\xde\x00\t\xa4type\xabBlockStored\xacblock_hashes\x92\xc4 " + b"\x01" * 32 + b"\x07"
    b"\xb1parent_block_hash\xc0\xa9token_ids\x94\x01\x02\x03\x04\xaablock_size\x02"
    b"\xa7lora_id\xc0\xa6medium\xa3GPU\xa9lora_name\xc0\xa9group_idx\x00"
    b"\x83\xa4type\xacBlockRemoved\xacblock_hashes\x91\x05\xa6medium\xa3GPU"
    b"\x81\xa4type\xb0AllBlocksCleared"
    b"\x03"
)


def stored_map(
    hashes: list[Any],
    parent: Any,
    tokens: list[int],
    block_size: int,
    **optional: Any,
) -> dict[str, Any]:
    """A BlockStored map as vLLM writes it: tag, the seven required keys, then set options."""
    event: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": block_size,
        "lora_id": optional.pop("lora_id", None),
        "medium": optional.pop("medium", "GPU"),
        "lora_name": optional.pop("lora_name", None),
    }
    event.update(optional)
    return event


def removed_map(hashes: list[Any], medium: str | None = "GPU", **optional: Any) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium, **optional}


def batch_bytes(events: list[dict[str, Any]], ts: float = 12.5, rank: int | None = 0) -> bytes:
    return pack([ts, events, rank])


# --- golden bytes ---------------------------------------------------------------


def test_vllm_captured_bytes_decode_to_the_events_vllm_encoded() -> None:
    decoded = decode_kv_batch(VLLM_BATCH_BYTES)
    assert decoded.unknown_events == 0
    batch = decoded.batch
    assert batch.ts == 1.5
    assert batch.data_parallel_rank == 3
    stored, removed, cleared = batch.events
    assert stored == BlockStored(
        block_hashes=[b"\x01" * 32, 7],
        parent_block_hash=None,
        token_ids=[1, 2, 3, 4],
        block_size=2,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=0,
    )
    assert removed == BlockRemoved(block_hashes=[5], medium="GPU")
    assert cleared == AllBlocksCleared()


def test_encoding_reproduces_vllm_bytes_exactly() -> None:
    batch = KVEventBatch(
        ts=1.5,
        events=[
            BlockStored(
                block_hashes=[b"\x01" * 32, 7],
                parent_block_hash=None,
                token_ids=[1, 2, 3, 4],
                block_size=2,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                group_idx=0,
            ),
            BlockRemoved(block_hashes=[5], medium="GPU"),
            AllBlocksCleared(),
        ],
        data_parallel_rank=3,
    )
    assert encode_kv_batch(batch) == VLLM_BATCH_BYTES


def test_every_optional_field_decodes_from_a_plain_map() -> None:
    event = stored_map(
        [HASH_B],
        HASH_A,
        [5, 6, 7, 8],
        4,
        lora_id=2,
        lora_name="adapter",
        medium="CPU",
        extra_keys=[["adapter", ["mm-hash", 1], "salt"]],
        group_idx=1,
        kv_cache_spec_kind="full_attention",
        kv_cache_spec_sliding_window=4096,
        locality="LOCAL",
        ownership="tier-2",
        session_id="chat-7",
        lookahead_token_ids=[[9]],
    )
    (stored,) = decode_kv_batch(batch_bytes([event])).batch.events
    assert isinstance(stored, BlockStored)
    assert stored.parent_block_hash == HASH_A
    assert stored.lora_id == 2
    assert stored.lora_name == "adapter"
    assert stored.medium == "CPU"
    assert stored.extra_keys == [["adapter", ["mm-hash", 1], "salt"]]
    assert stored.group_idx == 1
    assert stored.kv_cache_spec_kind == "full_attention"
    assert stored.kv_cache_spec_sliding_window == 4096
    assert stored.locality == "LOCAL"
    assert stored.ownership == "tier-2"
    assert stored.session_id == "chat-7"
    assert stored.lookahead_token_ids == [[9]]
    # Encoding gives back the same map, key for key.
    assert unpack(encode_kv_batch(decode_kv_batch(batch_bytes([event])).batch)) == [
        12.5,
        [event],
        0,
    ]


def test_integer_block_hashes_decode_as_ints() -> None:
    # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1: the low 64 bits of the hash, unsigned.
    top = (1 << 64) - 1
    events = [stored_map([top, 3], 17, [1, 2, 3, 4], 2), removed_map([top])]
    stored, removed = decode_kv_batch(batch_bytes(events)).batch.events
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert stored.block_hashes == [top, 3]
    assert stored.parent_block_hash == 17
    assert removed.block_hashes == [top]


def test_a_batch_without_rank_decodes_with_rank_none() -> None:
    batch = decode_kv_batch(pack([2.0, [{"type": "AllBlocksCleared"}]])).batch
    assert batch.data_parallel_rank is None
    assert batch.events == [AllBlocksCleared()]


def test_unknown_keys_in_an_event_are_ignored() -> None:
    event = stored_map([HASH_A], None, [1, 2], 2, future_field={"nested": [1, 2]})
    (stored,) = decode_kv_batch(batch_bytes([event])).batch.events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [HASH_A]


def test_unknown_event_tags_are_skipped_and_counted_and_the_rest_keeps_its_order() -> None:
    events = [
        stored_map([HASH_A], None, [1, 2], 2),
        {"type": "BlockPinned", "block_hashes": [HASH_A], "anything": [1, {"x": None}]},
        removed_map([HASH_A]),
        {"type": "SomethingNew"},
        {"type": "AllBlocksCleared"},
    ]
    decoded = decode_kv_batch(batch_bytes(events, rank=5))
    assert decoded.unknown_events == 2
    assert [type(event).__name__ for event in decoded.batch.events] == [
        "BlockStored",
        "BlockRemoved",
        "AllBlocksCleared",
    ]
    assert decoded.batch.data_parallel_rank == 5
    assert decoded.batch.ts == 12.5


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\xc1", "decode"),
        (b"", "decode"),
        (pack({"ts": 1.0}), "bad_value"),
        (pack([1.0]), "bad_value"),
        (pack(["soon", []]), "bad_value"),
        (pack([1.0, {}]), "bad_value"),
        (pack([1.0, [], -1]), "bad_value"),
        (pack([1.0, [], 70000]), "bad_value"),
        # Known tag, missing required field.
        (pack([1.0, [{"type": "BlockStored", "block_hashes": []}], 0]), "bad_value"),
        # Known tag, wrong type.
        (pack([1.0, [removed_map(["not-a-hash"])], 0]), "bad_value"),
        (pack([1.0, [stored_map([HASH_A], None, [-1, 2], 2)], 0]), "bad_value"),
        (pack([1.0, [stored_map([HASH_A], None, [1 << 32, 2], 2)], 0]), "bad_value"),
        (pack([1.0, [stored_map([HASH_A], None, [1, 2], 0)], 0]), "bad_value"),
        (pack([1.0, [stored_map([bytes(65)], None, [1, 2], 2)], 0]), "bad_value"),
        # Not a map, or a map without a tag.
        (pack([1.0, [7], 0]), "unexpected_type"),
        (pack([1.0, [["BlockStored", [HASH_A]]], 0]), "unexpected_type"),
        (pack([1.0, [{"block_hashes": [HASH_A]}], 0]), "unexpected_type"),
        (pack([1.0, [{"type": 3}], 0]), "unexpected_type"),
    ],
)
def test_bad_batches_are_refused_whole(payload: bytes, reason: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_kv_batch(payload)
    assert info.value.reason == reason


def test_a_bad_known_event_refuses_the_batch_even_beside_unknown_ones() -> None:
    events = [{"type": "Future"}, removed_map("no-list")]  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="BlockRemoved"):
        decode_kv_batch(batch_bytes(events))


def test_deep_nesting_is_a_decode_error() -> None:
    deep = b"\x91" * 100_000 + b"\xc0"
    with pytest.raises(ProtocolError):
        decode_kv_batch(pack([1.0, [{"type": "Future"}], 0])[:-2] + deep)
    with pytest.raises(ProtocolError):
        decode_kv_batch(b"\x93\xcb?\xf8\x00\x00\x00\x00\x00\x00\x91" + deep)


# --- frames -----------------------------------------------------------------------


def test_live_frames_are_topic_seq_payload() -> None:
    payload = batch_bytes([removed_map([HASH_A])], rank=1)
    message = decode_kv_frames([b"kv@rank1", (41).to_bytes(8, "big"), payload])
    assert message.topic == b"kv@rank1"
    assert message.seq == 41
    assert message.batch.data_parallel_rank == 1
    assert message.unknown_events == 0
    batch = KVEventBatch(ts=12.5, events=[BlockRemoved([HASH_A], "GPU")], data_parallel_rank=1)
    assert encode_kv_frames(41, batch, b"kv@rank1") == [
        b"kv@rank1",
        b"\x00\x00\x00\x00\x00\x00\x00\x29",
        encode_kv_batch(batch),
    ]
    assert unpack(encode_kv_batch(batch)) == unpack(payload)


def test_live_frames_count_unknown_events() -> None:
    payload = batch_bytes([{"type": "Mystery"}])
    assert decode_kv_frames([b"", bytes(8), payload]).unknown_events == 1


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([b"", bytes(8)], "frame_count"),
        ([b"", bytes(8), b"\x90", b""], "frame_count"),
        ([b"", bytes(7), pack([1.0, [], 0])], "bad_value"),
        ([b"", bytes(9), pack([1.0, [], 0])], "bad_value"),
        ([b"", END_SEQ, pack([1.0, [], 0])], "bad_value"),
        ([b"", bytes(8), b"\xc1"], "decode"),
    ],
)
def test_bad_live_frames(frames: list[bytes], reason: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_kv_frames(frames)
    assert info.value.reason == reason


def test_sequence_numbers_are_eight_big_endian_bytes() -> None:
    assert encode_seq(0) == bytes(8)
    assert encode_seq(258) == b"\x00\x00\x00\x00\x00\x00\x01\x02"
    assert encode_seq(MAX_SEQ) == b"\xff" * 7 + b"\xfe"
    assert decode_seq(encode_seq(MAX_SEQ)) == MAX_SEQ
    assert decode_seq(memoryview(encode_seq(9))) == 9
    for bad in (-1, MAX_SEQ + 1, True, 1.0):
        with pytest.raises(ValueError):
            encode_seq(bad)  # type: ignore[arg-type]


# --- replay -------------------------------------------------------------------------


def test_replay_request_frames() -> None:
    # What a subscriber's DEALER sends, and what the publisher's ROUTER then receives.
    assert encode_replay_request(5) == [b"", b"\x00\x00\x00\x00\x00\x00\x00\x05"]
    assert decode_replay_request([b"peer-1", b"", (5).to_bytes(8, "big")]) == (b"peer-1", 5)


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([b"peer", (5).to_bytes(8, "big")], "frame_count"),
        ([b"peer", b"x", (5).to_bytes(8, "big")], "unexpected_type"),
        ([b"peer", b"", b"\x05"], "bad_value"),
    ],
)
def test_bad_replay_requests(frames: list[bytes], reason: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_replay_request(frames)
    assert info.value.reason == reason


def test_replay_replies_and_the_end_marker() -> None:
    payload = batch_bytes([stored_map([HASH_A], None, [1, 2], 2)], rank=2)
    reply = decode_replay_frames([b"", b"topic", (7).to_bytes(8, "big"), payload])
    assert isinstance(reply, ReplayBatch)
    assert (reply.topic, reply.seq, reply.unknown_events) == (b"topic", 7, 0)
    assert reply.batch.data_parallel_rank == 2
    # vLLM's end marker: empty topic, -1 as 8 signed bytes, empty payload.
    end = [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
    assert decode_replay_frames(end) == ReplayEnd()
    assert encode_replay_end() == end
    assert encode_replay_batch(7, payload, b"topic") == [b"", b"topic", encode_seq(7), payload]


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([b"", END_SEQ, b""], "frame_count"),
        ([b"x", b"", END_SEQ, b""], "unexpected_type"),
        ([b"", b"", bytes(4), b""], "bad_value"),
        ([b"", b"", bytes(8), b""], "decode"),
    ],
)
def test_bad_replay_replies(frames: list[bytes], reason: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_replay_frames(frames)
    assert info.value.reason == reason


# --- endpoints ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "rank", "expected"),
    [
        # vLLM 0.33's own results for these inputs (offset_endpoint_port).
        ("tcp://*:5557", 0, "tcp://*:5557"),
        ("tcp://*:5557", 3, "tcp://*:5560"),
        ("tcp://*:0", 3, "tcp://*:0"),
        ("tcp://10.1.2.3:6000", 7, "tcp://10.1.2.3:6007"),
        ("tcp://[::1]:5557", 2, "tcp://[::1]:5559"),
        ("tcp_events", 2, "tcp_events"),
        ("inproc://cache", 2, "inproc://cache_dp2"),
        ("ipc:///tmp/kv", 0, "ipc:///tmp/kv"),
        ("", 4, ""),
    ],
)
def test_endpoints_offset_by_rank_as_vllm_does(endpoint: str, rank: int, expected: str) -> None:
    assert offset_endpoint(endpoint, rank) == expected


@pytest.mark.parametrize(
    "endpoint", ["ipc:///tmp/kv", "udp://x:1", "tcp://host:port", "tcp://host"]
)
def test_endpoints_vllm_cannot_offset_are_refused(endpoint: str) -> None:
    with pytest.raises(ValueError):
        offset_endpoint(endpoint, 1)


@pytest.mark.parametrize(
    ("endpoint", "binds"),
    [
        ("tcp://*:5557", True),
        ("tcp://[::]:5557", True),
        ("tcp://[::1]:5557", True),
        ("ipc:///tmp/kv", True),
        ("inproc://kv", True),
        ("tcp://127.0.0.1:5557", False),
        ("tcp://0.0.0.0:5557", False),
    ],
)
def test_which_endpoints_the_publisher_binds(endpoint: str, binds: bool) -> None:
    assert publisher_binds(endpoint) is binds


@pytest.mark.parametrize(
    ("endpoint", "rank", "engine_host", "replay", "expected"),
    [
        # The publisher binds a wildcard: connect to the engine's host, or loopback.
        ("tcp://*:5557", 2, "10.0.0.7", False, KVSubscription("tcp://10.0.0.7:5559", False)),
        ("tcp://*:5557", 2, None, False, KVSubscription("tcp://127.0.0.1:5559", False)),
        ("tcp://*:5557", 0, "fd00::7", False, KVSubscription("tcp://[fd00::7]:5557", False)),
        ("tcp://[::]:5557", 1, "[fd00::7]", False, KVSubscription("tcp://[fd00::7]:5558", False)),
        ("tcp://[::1]:5557", 1, "10.0.0.7", False, KVSubscription("tcp://[::1]:5558", False)),
        ("tcp://*:5557", 1, "engine-3", False, KVSubscription("tcp://engine-3:5558", False)),
        # The publisher connects: the coordinator binds the same address.
        ("tcp://127.0.0.1:6000", 4, None, False, KVSubscription("tcp://127.0.0.1:6004", True)),
        ("tcp://0.0.0.0:6000", 4, "10.0.0.7", False, KVSubscription("tcp://0.0.0.0:6004", True)),
        # The replay endpoint is always bound by the publisher.
        ("tcp://127.0.0.1:6000", 4, None, True, KVSubscription("tcp://127.0.0.1:6004", False)),
        ("tcp://*:6000", 4, "10.0.0.7", True, KVSubscription("tcp://10.0.0.7:6004", False)),
        ("ipc:///run/kv.sock", 0, None, False, KVSubscription("ipc:///run/kv.sock", False)),
    ],
)
def test_where_the_coordinator_reaches_each_rank(
    endpoint: str, rank: int, engine_host: str | None, replay: bool, expected: KVSubscription
) -> None:
    assert subscription_for(endpoint, rank, engine_host, replay=replay) == expected


@pytest.mark.parametrize(
    ("endpoint", "rank", "message"),
    [
        ("inproc://kv", 0, "inproc"),
        ("tcp://*:0", 2, "port 0"),
        ("ipc:///run/kv.sock", 1, "tcp and inproc"),
        ("", 0, "empty"),
        ("tcp://:5557", 0, "HOST:PORT"),
        ("tcp://*:99999", 0, "outside"),
        ("udp://*:5557", 0, "tcp:// or ipc://"),
        ("tcp://*:5557", -1, "DP rank"),
        ("tcp://*:5557", 70000, "DP rank"),
    ],
)
def test_unreachable_endpoints_are_refused(endpoint: str, rank: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        subscription_for(endpoint, rank)


# --- round trips and fuzzing ------------------------------------------------------------

block_hashes = st.one_of(st.binary(max_size=64), st.integers(-(1 << 63), (1 << 64) - 1))
token_lists = st.lists(st.integers(0, (1 << 32) - 1), max_size=32)
optional_text = st.none() | st.text(max_size=8)
extra_entries = st.none() | st.lists(
    st.one_of(st.text(max_size=8), st.tuples(st.text(max_size=8), st.integers(-64, 64)).map(list)),
    max_size=3,
)

stored_events = st.builds(
    BlockStored,
    block_hashes=st.lists(block_hashes, max_size=4),
    parent_block_hash=st.none() | block_hashes,
    token_ids=token_lists,
    block_size=st.integers(1, 64),
    lora_id=st.none() | st.integers(1, 100),
    medium=st.sampled_from([None, "GPU", "CPU"]),
    lora_name=optional_text,
    extra_keys=st.none() | st.lists(extra_entries, max_size=4),
    group_idx=st.none() | st.integers(0, 4),
    session_id=optional_text,
    lookahead_token_ids=st.none() | st.lists(token_lists, max_size=2),
)
removed_events = st.builds(
    BlockRemoved,
    block_hashes=st.lists(block_hashes, max_size=4),
    medium=st.sampled_from([None, "GPU", "CPU"]),
    group_idx=st.none() | st.integers(0, 4),
)
batches = st.builds(
    KVEventBatch,
    ts=st.floats(allow_nan=False),
    events=st.lists(
        st.one_of(stored_events, removed_events, st.just(AllBlocksCleared())), max_size=6
    ),
    data_parallel_rank=st.none() | st.integers(0, 65535),
)


@settings(max_examples=200, deadline=None)
@given(batches)
def test_batches_round_trip(batch: KVEventBatch) -> None:
    decoded = decode_kv_batch(encode_kv_batch(batch))
    assert decoded.unknown_events == 0
    assert decoded.batch == batch


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=40)
    | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type"]),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(
        st.sampled_from(
            ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "medium"]
        )
        | st.text(max_size=6),
        children,
        max_size=5,
    ),
    max_leaves=30,
)


def only_protocol_errors(call: Any, *args: Any) -> None:
    """Call a decoder on bad input: it may succeed or raise ProtocolError, nothing else."""
    with contextlib.suppress(ProtocolError):
        call(*args)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_raise_only_protocol_errors(data: bytes) -> None:
    only_protocol_errors(decode_kv_batch, data)
    only_protocol_errors(decode_kv_frames, [b"", data[:8], data[8:]])
    only_protocol_errors(decode_replay_frames, [b"", b"", data[:8], data[8:]])
    only_protocol_errors(decode_replay_request, [b"id", b"", data])


@settings(max_examples=300, deadline=None)
@given(
    st.floats() | st.integers(-(1 << 63), (1 << 64) - 1) | st.text(max_size=4),
    st.lists(msgpack_values, max_size=4),
)
def test_random_structures_raise_only_protocol_errors(ts: Any, events: list[Any]) -> None:
    only_protocol_errors(decode_kv_batch, pack([ts, events, 0]))


@settings(max_examples=300, deadline=None)
@given(batches, st.data())
def test_corrupted_batches_raise_only_protocol_errors(batch: KVEventBatch, data: Any) -> None:
    payload = bytearray(encode_kv_batch(batch))
    position = data.draw(st.integers(0, len(payload) - 1))
    payload[position] = data.draw(st.integers(0, 255))
    only_protocol_errors(decode_kv_batch, bytes(payload))
    only_protocol_errors(decode_kv_batch, bytes(payload[:position]))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=20), max_size=6))
def test_random_frame_lists_raise_only_protocol_errors(frames: list[bytes]) -> None:
    only_protocol_errors(decode_kv_frames, frames)
    only_protocol_errors(decode_replay_frames, frames)
    only_protocol_errors(decode_replay_request, frames)


# --- the engine's greeting ------------------------------------------------------------


def test_the_greeting_gives_block_size_and_the_publishers_resolved_endpoints() -> None:
    greeting = msgspec.msgpack.encode({
        "max_model_len": 4096, "num_gpu_blocks": 100, "block_size": 32,
        "data_parallel_rank": 3, "instance_id": "x",
        "kv_events_config": {
            "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5560",
            "replay_endpoint": "tcp://*:5660", "buffer_steps": 10000, "hwm": 100000,
            "max_queue_size": 100000, "topic": "kv",
        },
        "a_key_from_a_newer_vllm": [1, 2],
    })
    decoded = decode_greeting_kv(greeting)
    assert decoded == GreetingKV(32, PublisherSettings(True, "zmq", "tcp://*:5560",
                                                       "tcp://*:5660", "kv"), 3)
    assert decoded is not None and decoded.kv_events_config is not None
    assert decoded.kv_events_config.publishes


@pytest.mark.parametrize("settings", [
    {"enable_kv_cache_events": False, "publisher": "zmq", "endpoint": "tcp://*:5557"},
    {"enable_kv_cache_events": True, "publisher": "null", "endpoint": "tcp://*:5557"},
    {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": ""},
])
def test_a_greeting_without_a_zmq_publisher_says_so(settings: dict[str, Any]) -> None:
    decoded = decode_greeting_kv(msgspec.msgpack.encode({"kv_events_config": settings}))
    assert decoded is not None and decoded.kv_events_config is not None
    assert not decoded.kv_events_config.publishes


def test_greetings_without_kv_settings() -> None:
    assert decode_greeting_kv(b"") is None
    assert decode_greeting_kv(msgspec.msgpack.encode({"block_size": 16})) == GreetingKV(16)
    assert decode_greeting_kv(msgspec.msgpack.encode({"kv_events_config": None})) == GreetingKV()


@pytest.mark.parametrize(("payload", "reason"), [
    (b"\xc1", "decode"),
    (msgspec.msgpack.encode([1, 2]), "bad_value"),
    (msgspec.msgpack.encode({"block_size": 0}), "bad_value"),
    (msgspec.msgpack.encode({"kv_events_config": {"endpoint": 5}}), "bad_value"),
    (msgspec.msgpack.encode({"kv_events_config": {"endpoint": "x" * 2000}}), "bad_value"),
    (msgspec.msgpack.encode({"data_parallel_rank": -1}), "bad_value"),
])
def test_bad_greetings_raise_protocol_errors(payload: bytes, reason: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_greeting_kv(payload)
    assert info.value.reason == reason
