"""Engine input frames (ADD, ABORT, START_DP_WAVE, UTILITY) parsed into typed records."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.protocol.engine_input import (
    MAX_UTILITY_CALL_ID,
    AbortRequests,
    AddRequest,
    StartDpWave,
    UtilityCall,
    encode_utility,
    parse_engine_input,
)
from coordinator.protocol.errors import ProtocolError
from coordinator.protocol.frontend import MAX_CLIENT_INDEX

FAST = settings(max_examples=300, deadline=None)
SOURCE = 7


def pack(value: Any) -> bytes:
    return msgspec.msgpack.encode(value)


def hexb(text: str) -> bytes:
    return bytes.fromhex(text)


# What a vLLM 0.33 frontend sends for `call_utility("is_sleeping")` from client 0:
# the type byte, then (client_index, call_id, method, args) as one msgpack array,
# args being the empty tuple of positional arguments; call_id is uuid1().int >> 64.
VLLM_IS_SLEEPING = [
    b"\x03",
    hexb("94 00 cf 0123456789abcdef ab") + b"is_sleeping" + hexb("90"),
]


def test_a_vllm_utility_call_parses_field_by_field() -> None:
    request = parse_engine_input(VLLM_IS_SLEEPING, SOURCE)
    assert request == UtilityCall(
        client_index=0, call_id=0x0123456789ABCDEF, method="is_sleeping", args=[],
        source=SOURCE, frames=(VLLM_IS_SLEEPING[1],),
    )


def test_encode_utility_writes_vllms_bytes() -> None:
    assert encode_utility(0, 0x0123456789ABCDEF, "is_sleeping") == VLLM_IS_SLEEPING


def test_utility_keeps_the_zero_copy_frames_that_follow_the_call() -> None:
    # vLLM's encoder moves a large tensor argument into a frame of its own.
    frames = [b"\x03", pack([2, 5, "collective_rpc", ["method", {"__tensor__": 0}]]),
              b"\x00" * 64]
    request = parse_engine_input(frames, SOURCE)
    assert isinstance(request, UtilityCall)
    assert (request.client_index, request.call_id, request.method) == (2, 5, "collective_rpc")
    assert request.frames == (frames[1], frames[2])


def test_the_other_request_types() -> None:
    assert parse_engine_input([b"\x02", pack([4, 1])], SOURCE) == StartDpWave(
        wave=4, exclude=1, source=SOURCE, frames=(pack([4, 1]),)
    )
    assert parse_engine_input([b"\x02", pack([4, None])], SOURCE) == StartDpWave(
        wave=4, exclude=None, source=SOURCE, frames=(pack([4, None]),)
    )
    assert parse_engine_input([b"\x00", b"opaque", b"aux"], SOURCE) == AddRequest(
        source=SOURCE, frames=(b"opaque", b"aux")
    )
    assert parse_engine_input([b"\x01", pack(["a", "b"])], SOURCE) == AbortRequests(
        request_ids=["a", "b"], source=SOURCE, frames=(pack(["a", "b"]),)
    )
    assert parse_engine_input([b"READY"], SOURCE) is None


@pytest.mark.parametrize(("frames", "reason"), [
    ([], "frame_count"),
    ([b"\x09", b"whatever"], "unexpected_type"),
    ([b"\x04"], "unexpected_type"),
    ([b"\x00"], "frame_count"),
    ([b"\x01"], "frame_count"),
    ([b"\x01", pack(["a"]), b"extra"], "frame_count"),
    ([b"\x01", b"\xc1"], "decode"),
    ([b"\x01", pack([1, 2])], "bad_value"),
    ([b"\x02", pack([1, 0]), b"extra"], "frame_count"),
    ([b"\x02", pack(["not", "a wave"])], "bad_value"),
    ([b"\x02", pack([-1, 0])], "bad_value"),
    ([b"\x03"], "frame_count"),
    ([b"\x03", b"\xc1"], "decode"),
    ([b"\x03", pack([0, 1, "too short"])], "bad_value"),
    ([b"\x03", pack([0, 1, "too long", [], "extra"])], "bad_value"),
    ([b"\x03", pack({"client_index": 0})], "bad_value"),
    ([b"\x03", pack([True, 1, "m", []])], "bad_value"),
    ([b"\x03", pack([-1, 1, "m", []])], "bad_value"),
    ([b"\x03", pack([MAX_CLIENT_INDEX + 1, 1, "m", []])], "bad_value"),
    ([b"\x03", pack([0, -1, "m", []])], "bad_value"),
    ([b"\x03", pack([0, 1.5, "m", []])], "bad_value"),
    ([b"\x03", pack([0, 1, b"m", []])], "bad_value"),
    ([b"\x03", pack([0, 1, "m", {"k": 1}])], "bad_value"),
    ([b"\x03", pack([0, 1, "m", None])], "bad_value"),
])
def test_malformed_input_is_a_protocol_error_with_a_reason(
    frames: list[bytes], reason: str
) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_engine_input(frames, SOURCE)
    assert info.value.reason == reason


_args = st.lists(st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1),
                           st.text(max_size=8), st.binary(max_size=8)), max_size=4)


@FAST
@given(
    client_index=st.integers(0, MAX_CLIENT_INDEX),
    call_id=st.integers(0, MAX_UTILITY_CALL_ID),
    method=st.text(max_size=32),
    args=_args,
)
def test_utility_round_trips(client_index: int, call_id: int, method: str,
                             args: list[Any]) -> None:
    frames = encode_utility(client_index, call_id, method, args)
    request = parse_engine_input(frames, SOURCE)
    assert isinstance(request, UtilityCall)
    assert (request.client_index, request.call_id, request.method, request.args) == (
        client_index, call_id, method, args)


@pytest.mark.parametrize(("client_index", "call_id", "method"), [
    (-1, 0, "m"), (MAX_CLIENT_INDEX + 1, 0, "m"), (True, 0, "m"),
    (0, -1, "m"), (0, MAX_UTILITY_CALL_ID + 1, "m"), (0, False, "m"), (0, 0, b"m"),
])
def test_encode_utility_refuses_values_the_parser_would_drop(
    client_index: Any, call_id: Any, method: Any
) -> None:
    with pytest.raises(ValueError):
        encode_utility(client_index, call_id, method)


@FAST
@given(st.lists(st.binary(max_size=24), max_size=4), st.sampled_from([b"\x00", b"\x01", b"\x02",
                                                                       b"\x03", b"READY", b""]))
def test_any_frames_parse_or_raise_protocol_error_only(tail: list[bytes], head: bytes) -> None:
    try:
        request = parse_engine_input([head, *tail], SOURCE)
    except ProtocolError as exc:
        assert exc.reason in ("frame_count", "unexpected_type", "decode", "bad_value")
        return
    if request is not None:
        assert request.source == SOURCE
        assert request.frames == tuple(tail)
