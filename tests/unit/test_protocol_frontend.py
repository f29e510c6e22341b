"""The frontend protocol: exact bytes, round trips, and bad input at the edge."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.protocol import frontend as fp
from coordinator.protocol.errors import ProtocolError

REQUESTS: list[Any] = [
    fp.Register(1, 0, "ipc:///tmp/out0"),
    fp.Register(2, 3, "tcp://127.0.0.1:5000", "tcp://127.0.0.1:5001"),
    fp.Abort(4, ["a", "b"]),
    fp.Finished(["a"]),
    fp.QueryState(5),
    fp.Admin(6, "cordon", 2),
    fp.Admin(7, "uncordon", 2),
    fp.Admin(8, "drain", 65535),
    fp.Route(9, "r9"),
    fp.Route(10, "r10", [0, 3], fp.PromptKeys([1, 2, 3], "adapter", "salt",
                                             [fp.MultiModalItem("img-1", 2, 4)], "chat-7")),
]

REPLIES: list[Any] = [
    fp.Registered(1, 0, 0, 4, 7, True, True),
    fp.Submitted(2, "r1", 3, False),
    fp.Routed(7, "r9", 2, "prefix"),
    fp.Aborted(3, ["a"]),
    fp.StateReply(
        4,
        fp.GroupState(
            wave=2, running=False, lockstep=True, rank_start=0, rank_count=1, frontends=1,
            in_flight=0,
            engines=[fp.EngineStatus(0, "ready", "e0", 1, 2, 0.5, 0, 3, 0.25)],
            counters={"x": 1},
        ),
    ),
    fp.AdminDone(5, 1, "cordoned"),
    fp.ErrorReply(6, fp.ERR_UNKNOWN_RANK, "no such rank", "r9"),
    fp.RequestsFailed(["r1", "r2"], 3, "engine died"),
    fp.RankDrained(2),
    fp.ShuttingDown("SIGTERM"),
]


def test_submit_bytes_put_the_tag_first_and_fields_in_order() -> None:
    header = fp.encode(fp.Submit(call_id=1, request_id="r1", wave=3))
    assert header == b"\x95\xa6submit\x01\xa2r1\x03\xc0"
    assert msgspec.msgpack.decode(header) == ["submit", 1, "r1", 3, None]


def test_a_submit_with_prompt_keys_adds_them_as_a_sixth_element() -> None:
    prompt = fp.PromptKeys([7, 8], session_id="s")
    header = fp.encode(fp.Submit(call_id=1, request_id="r1", wave=3, prompt=prompt))
    assert msgspec.msgpack.decode(header) == ["submit", 1, "r1", 3, None,
                                              [[7, 8], None, None, None, "s"]]
    message, payload = fp.decode_request([header, b"p"])
    assert message == fp.Submit(1, "r1", 3, None, prompt) and payload == [b"p"]
    # A frontend that leaves the keys' trailing defaults out is read the same way.
    short = msgspec.msgpack.encode(["submit", 1, "r1", 3, None, [[7, 8]]])
    assert fp.decode_request([short, b"p"])[0] == fp.Submit(1, "r1", 3, None, fp.PromptKeys([7, 8]))


def test_route_bytes() -> None:
    header = fp.encode(fp.Route(2, "r2", [1], fp.PromptKeys([5])))
    assert header == b"\x95\xa5route\x02\xa2r2\x91\x01\x95\x91\x05\xc0\xc0\xc0\xc0"
    assert fp.encode(fp.Routed(2, "r2", 1, "prefix")) == b"\x95\xa6routed\x02\xa2r2\x01\xa6prefix"


def test_submit_keeps_payload_frames_untouched() -> None:
    header = fp.encode(fp.Submit(call_id=9, request_id="r", wave=0, dp_rank=2))
    message, payload = fp.decode_request([header, b"\x00\xff", b""])
    assert message == fp.Submit(9, "r", 0, 2)
    assert payload == [b"\x00\xff", b""]


@pytest.mark.parametrize("message", REQUESTS, ids=lambda m: type(m).__name__)
def test_every_request_round_trips(message: Any) -> None:
    decoded, payload = fp.decode_request([fp.encode(message)])
    assert decoded == message
    assert payload == []


@pytest.mark.parametrize("message", REPLIES, ids=lambda m: type(m).__name__)
def test_every_reply_round_trips(message: Any) -> None:
    assert fp.decode_reply(fp.encode(message)) == message


def test_call_id_of_is_zero_for_messages_without_one() -> None:
    assert fp.call_id_of(fp.Finished(["a"])) == 0
    assert fp.call_id_of(fp.QueryState(42)) == 42


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([], "frame_count"),
        ([fp.encode(fp.Submit(1, "r", 0))], "frame_count"),  # submit without payload
        ([fp.encode(fp.QueryState(1)), b"extra"], "frame_count"),
        ([b"\xc1"], "decode"),  # never-used msgpack byte
        ([msgspec.msgpack.encode(["nope", 1])], "decode"),  # unknown tag
        ([msgspec.msgpack.encode(["submit", 1, "", 0, None]), b"p"], "decode"),  # empty id
        ([msgspec.msgpack.encode(["submit", -1, "r", 0, None]), b"p"], "decode"),
        ([msgspec.msgpack.encode(["submit", 1, "r", 2**32, None]), b"p"], "decode"),
        ([msgspec.msgpack.encode(["submit", 1, "r", 0, 65536]), b"p"], "decode"),
        ([msgspec.msgpack.encode(["admin", 1, "reboot", 0])], "decode"),
        ([msgspec.msgpack.encode(["register", 1, 0, ""])], "decode"),
        ([msgspec.msgpack.encode(["abort", 1, ["a"] * (fp.MAX_ABORT_IDS + 1)])], "decode"),
        ([msgspec.msgpack.encode({"kind": "state", "call_id": 1})], "decode"),
        ([msgspec.msgpack.encode(["submit", 1, "r", 0, None, [[-1]]]), b"p"], "decode"),
        ([msgspec.msgpack.encode(["submit", 1, "r", 0, None, [[2**32]]]), b"p"], "decode"),
        ([msgspec.msgpack.encode(["submit", 1, "r", 0, None, [[1], None, None,
                                                             [["i", -1, 1]]]]), b"p"], "decode"),
        ([msgspec.msgpack.encode(["route", 1, "r", [65536]])], "decode"),
        ([msgspec.msgpack.encode(["route", 1, "r"]), b"payload"], "frame_count"),
    ],
)
def test_bad_requests_raise_protocol_error_with_a_reason(frames: list[bytes], reason: str) -> None:
    with pytest.raises(ProtocolError) as info:
        fp.decode_request(frames)
    assert info.value.reason == reason


def test_bad_reply_raises_protocol_error() -> None:
    with pytest.raises(ProtocolError) as info:
        fp.decode_reply(b"\x93\xa4nope\x01\x02")
    assert info.value.reason == "decode"


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.text(max_size=5), children, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=4))
def test_random_frames_only_ever_raise_protocol_error(frames: list[bytes]) -> None:
    with contextlib.suppress(ProtocolError):
        fp.decode_request(frames)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["register", "submit", "route", "abort", "finished", "state", "admin",
                        "x"]),
       st.lists(msgpack_values, max_size=6), st.lists(st.binary(max_size=8), max_size=2))
def test_wrong_shaped_headers_only_ever_raise_protocol_error(
    tag: str, fields: list[Any], payload: list[bytes]
) -> None:
    header = msgspec.msgpack.encode([tag, *fields])
    with contextlib.suppress(ProtocolError):
        fp.decode_request([header, *payload])
    with contextlib.suppress(ProtocolError):
        fp.decode_reply(header)


@pytest.mark.parametrize(
    ("header", "call_id"),
    [
        (msgspec.msgpack.encode(["submit", 17, "", 0, None]), 17),  # readable id, bad field
        (msgspec.msgpack.encode(["nope", 5]), 5),
        (msgspec.msgpack.encode(["state", -1]), 0),
        (msgspec.msgpack.encode(["state", True]), 0),
        (msgspec.msgpack.encode(["state", 2**64 - 1]), 0),
        (msgspec.msgpack.encode(["state"]), 0),
        (msgspec.msgpack.encode({"a": 1}), 0),
        (b"\xc1", 0),
        (b"\x91" * 5000, 0),  # nesting deep enough to exhaust the decoder
    ],
)
def test_salvage_call_id_recovers_only_a_plausible_id(header: bytes, call_id: int) -> None:
    assert fp.salvage_call_id(header) == call_id


def test_payload_error_names_the_wire_tag() -> None:
    with pytest.raises(ProtocolError, match="'state' takes no payload frames"):
        fp.decode_request([fp.encode(fp.QueryState(1)), b"x"])


def test_group_state_to_builtins_names_every_engine_field() -> None:
    state = fp.GroupState(
        wave=3, running=True, lockstep=True, rank_start=4, rank_count=2, frontends=1,
        in_flight=5, counters={"submit.dispatched": 9},
        engines=[fp.EngineStatus(4, "ready", "e4", 1, 2, 0.5, 0, 3, 0.25),
                 fp.EngineStatus(5, "dead", None, 0, 0, 0.0, 0, 0, None)],
    )
    data = fp.group_state_to_builtins(state)
    assert json.loads(json.dumps(data)) == data
    assert data["engines"][1] == {
        "rank": 5, "state": "dead", "engine_id": None, "waiting": 0, "running": 0,
        "kv_cache_usage": 0.0, "dispatched_since_report": 0, "in_flight": 0,
        "last_seen_age_s": None, "vllm_version": None,
    }
    assert data["engines"][0]["rank"] == 4 and data["engines"][0]["last_seen_age_s"] == 0.25
    assert {k: v for k, v in data.items() if k != "engines"} == {
        "wave": 3, "running": True, "lockstep": True, "rank_start": 4, "rank_count": 2,
        "frontends": 1, "in_flight": 5, "counters": {"submit.dispatched": 9},
        "shutting_down": False, "version": "",
    }


def test_the_state_reply_with_a_version_decodes_where_it_had_none() -> None:
    """``version`` came after the other keys: old and new decoders read both replies."""
    old_decoder = msgspec.msgpack.Decoder(OldGroupState)
    new = fp.GroupState(wave=1, running=False, lockstep=True, rank_start=0, rank_count=1,
                        frontends=0, in_flight=0, engines=[], counters={}, version="9.9")
    assert old_decoder.decode(msgspec.msgpack.encode(new)).wave == 1
    old = OldGroupState(wave=1, running=False, lockstep=True, rank_start=0, rank_count=1,
                        frontends=0, in_flight=0, engines=[], counters={})
    decoded = msgspec.msgpack.Decoder(fp.GroupState).decode(msgspec.msgpack.encode(old))
    assert decoded.version == "" and decoded.shutting_down is False


class OldGroupState(msgspec.Struct, frozen=True):
    """The state reply's map as decoders before ``version`` (and ``shutting_down``) saw it."""

    wave: int
    running: bool
    lockstep: bool
    rank_start: int
    rank_count: int
    frontends: int
    in_flight: int
    engines: list[fp.EngineStatus]
    counters: dict[str, int]
