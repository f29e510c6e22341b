"""The KV plane alone: settings, where publishers are, the block size, the apply queue."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.core.dispatch.prefix_policy import SessionPrompts
from coordinator.core.events import EngineGreeted, KVBadMessage, KVBatchReceived, KVReplayEnded
from coordinator.core.kv.plane import KVPlane, KVSettings
from coordinator.core.kv.prefix_index import PrefixIndex
from coordinator.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    GreetingKV,
    KVEventBatch,
    KVSubscription,
    PublisherSettings,
    encode_kv_batch,
    encode_kv_frames,
    encode_replay_batch,
    encode_replay_end,
    encode_seq,
)
from coordinator.server.planes import dispatch
from coordinator.server.planes.kv_events import decode_live, decode_replay


def stored(count: int, *, block: int = 2, first: int = 1, parent: int | None = None,
           **fields: Any) -> BlockStored:
    return BlockStored(block_hashes=list(range(first, first + count)), parent_block_hash=parent,
                       token_ids=[(first * 7 + i) % 50 for i in range(count * block)],
                       block_size=block, lora_id=None, medium=None, lora_name=None, **fields)


@pytest.mark.parametrize(("fields", "message"), [
    ({"endpoint": "inproc://x"}, "inproc"),
    ({"endpoint": "tcp://*:0"}, "port 0"),
    ({"replay_endpoint": "udp://x:1"}, "tcp:// or ipc://"),
    ({"block_size": 0}, "block size"),
    ({"apply_budget_blocks": 0}, "budget"),
])
def test_bad_settings_are_refused_with_a_reason(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVSettings(**fields)


def test_settings_say_whether_anything_is_followed() -> None:
    assert KVSettings().enabled
    assert not KVSettings(from_greetings=False).enabled
    assert KVSettings(endpoint="ipc:///tmp/kv", from_greetings=False).enabled


def test_configured_and_announced_subscriptions() -> None:
    plane = KVPlane(KVSettings(endpoint="tcp://*:5557", replay_endpoint="tcp://*:5600"))
    sub = plane.configured_subscription(2, "10.0.0.2")
    assert sub == (KVSubscription("tcp://10.0.0.2:5559", False), "tcp://10.0.0.2:5602",
                   "configured")
    announced = GreetingKV(16, PublisherSettings(True, "zmq", "tcp://10.0.0.9:7000", None), 2)
    assert plane.greeted_subscription(2, announced, "10.0.0.2") == (
        KVSubscription("tcp://10.0.0.9:7000", True), None, "greeting")
    quiet = GreetingKV(16, PublisherSettings(False, "null", "", None), 2)
    assert plane.greeted_subscription(2, quiet, None) == plane.configured_subscription(2)
    assert KVPlane(KVSettings()).configured_subscription(0) is None
    ignoring = KVPlane(KVSettings(from_greetings=False, endpoint="ipc:///tmp/kv"))
    assert ignoring.greeted_subscription(0, announced, None) == (
        KVSubscription("ipc:///tmp/kv", False), None, "configured")


def test_the_block_size_comes_from_settings_then_greetings_then_events() -> None:
    fixed = KVPlane(KVSettings(block_size=8))
    assert not fixed.learn_block_size(16, "greeting")
    assert fixed.index is not None and fixed.index.block_size == 8
    plane = KVPlane(KVSettings())
    assert plane.index is None
    assert plane.learn_block_size(4, "event")
    assert not plane.learn_block_size(8, "event")  # a first event's size stands against events
    assert plane.learn_block_size(8, "greeting")  # a greeting overrules it
    assert not plane.learn_block_size(8, "greeting")
    assert plane.index is not None and plane.index.block_size == 8
    assert plane.block_size_source == "greeting"


def test_a_new_block_size_empties_everything_and_restarts_the_streams() -> None:
    plane = KVPlane(KVSettings(endpoint="tcp://*:5557"))
    sub = plane.configured_subscription(0)
    assert sub is not None
    plane.subscribe(0, sub)
    plane.enqueue(0, KVEventBatch(0.0, [stored(3)]))
    plane.drain(100)
    assert plane.index is not None and plane.index.blocks(0) == 3
    plane.enqueue(0, KVEventBatch(0.0, [stored(2, first=10)]))
    assert plane.learn_block_size(4, "greeting")
    assert plane.pending_blocks == 0 and plane.index.blocks(0) == 0


def test_the_queue_is_bounded_and_skips_what_an_emptied_index_no_longer_wants() -> None:
    plane = KVPlane(KVSettings(block_size=2, max_pending_blocks=5))
    plane.enqueue(0, KVEventBatch(0.0, [stored(3)]))
    assert not plane.backlog_full
    plane.enqueue(1, KVEventBatch(0.0, [stored(2, first=20), AllBlocksCleared()]))
    assert plane.backlog_full and plane.pending_blocks == 6
    plane.reset_rank(0, "rank_gone")
    assert plane.drain(100) == 3  # rank 0's blocks are skipped, rank 1's applied
    assert plane.pending_blocks == 0
    assert plane.cached_blocks([0, 1]) == {0: 0, 1: 0}  # cleared after the store
    assert plane.counters.resets == {"rank_gone": 1}
    plane.enqueue(1, KVEventBatch(0.0, []))  # nothing to apply: nothing queued
    assert plane.pending_blocks == 0


@settings(max_examples=100, deadline=None)
@given(count=st.integers(1, 40), chunk=st.integers(1, 9), removed=st.integers(0, 40),
       extras=st.booleans())
def test_events_cut_into_parts_leave_the_index_as_the_whole_event_would(
    count: int, chunk: int, removed: int, extras: bool
) -> None:
    keys = [[f"k{i}"] if i % 3 == 0 else None for i in range(count)] if extras else None
    events = [stored(count, first=100, extra_keys=keys),
              BlockRemoved(list(range(100, 100 + min(removed, count))), None)]
    whole = PrefixIndex(2)
    for event in events:
        whole.apply(5, event)
    plane = KVPlane(KVSettings(block_size=2, apply_budget_blocks=chunk))
    plane.enqueue(5, KVEventBatch(0.0, events))
    while plane.pending_blocks:
        assert plane.drain(chunk) <= chunk
    assert plane.index is not None
    prompt = whole.prompt([(100 * 7 + i) % 50 for i in range(count * 2)] + [0])
    assert plane.index.cached_blocks(prompt, [5]) == whole.cached_blocks(prompt, [5])
    assert plane.index.blocks(5) == whole.blocks(5)


def test_events_the_index_would_skip_whole_are_not_cut() -> None:
    ragged = BlockStored([1, 2, 3], None, [1, 2, 3], 2, None, None, None)
    plane = KVPlane(KVSettings(block_size=2, apply_budget_blocks=1))
    plane.enqueue(0, KVEventBatch(0.0, [ragged]))
    assert plane.pending_blocks == 3
    plane.drain(1)
    assert plane.pending_blocks == 0
    assert plane.index is not None and plane.index.counters.skipped_blocks == 3


# ---- the server's decoding of what publishers send ---------------------------------------


@settings(max_examples=300, deadline=None)
@given(frames=st.lists(st.binary(max_size=40), max_size=5))
def test_anything_a_publisher_sends_becomes_an_event(frames: list[bytes]) -> None:
    live = decode_live(3, frames)
    assert isinstance(live, (KVBatchReceived, KVBadMessage)) and live.rank == 3
    replayed = decode_replay(3, frames)
    assert isinstance(replayed, (KVBatchReceived, KVReplayEnded, KVBadMessage))
    if isinstance(replayed, (KVBatchReceived, KVBadMessage)):
        assert replayed.replayed


def test_decoded_publisher_messages() -> None:
    batch = KVEventBatch(1.0, [stored(1)], 3)
    assert decode_live(3, encode_kv_frames(7, batch)) == KVBatchReceived(3, 7, batch, 0)
    assert decode_replay(3, encode_replay_batch(7, encode_kv_batch(batch))) == KVBatchReceived(
        3, 7, batch, 0, replayed=True)
    assert decode_replay(3, encode_replay_end()) == KVReplayEnded(3)
    bad = decode_live(3, [b"", encode_seq(9), b"\xc1"])
    assert isinstance(bad, KVBadMessage) and bad.seq == 9 and bad.error.reason == "decode"
    unreadable = decode_live(3, [b"", b"short", b"\xc1"])
    assert isinstance(unreadable, KVBadMessage) and unreadable.seq is None
    bad_replay = decode_replay(3, [b"", b"", encode_seq(4), b"\xc1"])
    assert isinstance(bad_replay, KVBadMessage) and bad_replay.seq == 4 and bad_replay.replayed


def test_the_dispatch_greeting_is_read_for_its_kv_settings_and_the_engines_host() -> None:
    greeting = msgspec.msgpack.encode({"block_size": 32, "kv_events_config": {
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557"}})
    event = dispatch.decode([b"\x01\x00", greeting], peer="10.0.0.7")
    assert event == EngineGreeted(1, kv=GreetingKV(32, PublisherSettings(True, "zmq",
                                                                         "tcp://*:5557")),
                                  host="10.0.0.7")
    assert dispatch.decode([b"\x01\x00", b""]) == EngineGreeted(1)
    assert dispatch.decode([b"\x01\x00", b"\xc1"]) == EngineGreeted(1, kv_unreadable=True)
    assert dispatch.decode([b"\x01\x00", b"a", b"b"]) == EngineGreeted(1)  # not one frame


def test_session_prompts_are_bounded_by_the_bytes_they_hold() -> None:
    index = PrefixIndex(2)
    prompts = SessionPrompts(max_bytes=3 * index.prompt([1] * 41).nbytes)
    for session in "abc":
        prompts.put(session, index.prompt([1] * 41))
    assert len(prompts) == 3 and prompts.nbytes <= prompts.max_bytes
    prompts.put("a", index.prompt([2] * 41))  # replaced, and now the newest
    prompts.put("d", index.prompt([3] * 41))  # b, the oldest, makes room
    assert prompts.get("b") is None and prompts.get("a") is not None
    assert prompts.get(None) is None
    prompts.put("huge", index.prompt([1] * 4001))  # larger than the bound: not kept
    assert prompts.get("huge") is None and len(prompts) == 3
