"""tools/fuzz.py's classifier: valid state changes are held back, everything else is sent."""

from __future__ import annotations

import msgspec

from coordinator.protocol.identity import rank_to_identity
from tools.fuzz import FuzzMessage, classify

MANAGED = range(0, 4)


def front(*frames: bytes) -> FuzzMessage:
    return FuzzMessage("front_publish", frames)


def test_a_pre_033_wake_for_a_managed_rank_is_valid_input_and_held_back() -> None:
    # Honoured by default, it may start a wave: the fuzz pass checks nothing moved.
    for head in (2, rank_to_identity(2)):
        skip, findings = classify(front(msgspec.msgpack.encode([head, 3])), MANAGED)
        assert skip and findings == []


def test_a_wake_for_another_rank_a_resize_and_garbage_are_sent() -> None:
    for frames in ([msgspec.msgpack.encode([9, 3])],
                   [msgspec.msgpack.encode(["SCALE_ELASTIC_EP", 8])],
                   [b"\xc1garbage"]):
        skip, _ = classify(front(*frames), MANAGED)
        assert not skip, frames
