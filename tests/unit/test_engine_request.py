"""Reading the prefix-cache fields of vLLM 0.33 ADD payloads.

Payloads are built from plain lists and maps laid out as vLLM 0.33's
`EngineCoreRequest` (an array of 22 fields in declaration order, every field
written), with nested vLLM types as vLLM's serializer writes them.
"""

from __future__ import annotations

import contextlib
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.protocol.engine_request import (
    AddRequestHead,
    LoraRef,
    MultiModalPlaceholder,
    PlaceholderRange,
    decode_add_request,
)
from coordinator.protocol.errors import ProtocolError

pack = msgspec.msgpack.encode
Ext = msgspec.msgpack.Ext

# vLLM's serializer writes small tensors inline as [dtype, shape, Ext(3, raw bytes)]
# and large ones as [dtype, shape, index of a later frame].
INLINE_TENSOR = ["float16", [2, 2], Ext(3, bytes(8))]
OUT_OF_BAND_TENSOR = ["bfloat16", [4096, 1024], 1]

SAMPLING_PARAMS = {"temperature": 0.0, "max_tokens": 64, "stop": ["\n\n"], "seed": 7}


def add_fields(**overrides: Any) -> list[Any]:
    """The 22 EngineCoreRequest fields in vLLM 0.33's order, with its defaults."""
    fields: dict[str, Any] = {
        "request_id": "req-1",
        "prompt_token_ids": [1, 2, 3],
        "mm_features": None,
        "sampling_params": SAMPLING_PARAMS,
        "pooling_params": None,
        "arrival_time": 1_700_000_000.25,
        "lora_request": None,
        "cache_salt": None,
        "data_parallel_rank": None,
        "prompt_embeds": None,
        "prompt_is_token_ids": None,
        "client_index": 0,
        "current_wave": 0,
        "priority": 0,
        "trace_headers": None,
        "resumable": False,
        "external_req_id": None,
        "reasoning_ended": None,
        "reasoning_parser_kwargs": None,
        "abort_immediately": False,
        "session_id": None,
        "kv_hints": None,
    }
    unknown = set(overrides) - set(fields)
    assert not unknown, unknown
    fields.update(overrides)
    return list(fields.values())


def add_payload(**overrides: Any) -> bytes:
    return pack(add_fields(**overrides))


def mm_feature(identifier: str, offset: int, length: int, data: Any = None) -> dict[str, Any]:
    """A `MultiModalFeatureSpec` dataclass as vLLM's encoder writes it (a map)."""
    return {
        "data": data,
        "modality": "image",
        "identifier": identifier,
        "mm_position": {"offset": offset, "length": length, "is_embed": None},
        "mm_hash": identifier,
    }


def test_a_plain_text_request() -> None:
    head = decode_add_request(add_payload(prompt_token_ids=[10, 20, 30, 151_643]))
    assert head.request_id == "req-1"
    assert head.prompt_token_ids == [10, 20, 30, 151_643]
    assert head.mm_features is None
    assert head.lora_request is None and head.lora_name is None
    assert head.cache_salt is None
    assert head.data_parallel_rank is None
    assert head.session_id is None
    assert not head.has_prompt_embeds
    assert head.cacheable


def test_every_cache_relevant_field() -> None:
    lora = ["sql-adapter", 3, "/adapters/sql", None, False, False]
    image = {
        "pixel_values": {"data": INLINE_TENSOR, "field": ["batched", {"keep_on_cpu": False}]}
    }
    payload = add_payload(
        prompt_token_ids=list(range(40)),
        mm_features=[mm_feature("img-a", 4, 16, data=image), mm_feature("img-b", 30, 8)],
        lora_request=lora,
        cache_salt="tenant-7",
        data_parallel_rank=5,
        session_id="chat-42",
        trace_headers={"traceparent": "00-abc-def-01"},
        priority=-3,
    )
    head = decode_add_request(payload)
    assert head.prompt_token_ids == list(range(40))
    assert head.mm_features == [
        MultiModalPlaceholder("img-a", PlaceholderRange(4, 16)),
        MultiModalPlaceholder("img-b", PlaceholderRange(30, 8)),
    ]
    assert head.lora_request == LoraRef("sql-adapter", 3, "/adapters/sql")
    assert head.lora_name == "sql-adapter"
    assert head.cache_salt == "tenant-7"
    assert head.data_parallel_rank == 5
    assert head.session_id == "chat-42"
    assert head.cacheable


def test_prompt_embeddings_make_a_request_uncacheable() -> None:
    for tensor in (INLINE_TENSOR, OUT_OF_BAND_TENSOR):
        head = decode_add_request(add_payload(prompt_token_ids=None, prompt_embeds=tensor))
        assert head.has_prompt_embeds
        assert not head.cacheable
        mixed = decode_add_request(
            add_payload(prompt_embeds=tensor, prompt_is_token_ids=[True, False, True])
        )
        assert mixed.prompt_token_ids == [1, 2, 3]
        assert not mixed.cacheable


def test_a_request_without_token_ids_is_uncacheable() -> None:
    head = decode_add_request(add_payload(prompt_token_ids=None))
    assert head.prompt_token_ids is None
    assert not head.cacheable


def test_shorter_and_longer_arrays() -> None:
    # Only the first nine fields have no default; later ones may be missing.
    short = pack(add_fields()[:9])
    head = decode_add_request(short)
    assert head.session_id is None and not head.has_prompt_embeds
    # Fields a later vLLM may append are ignored.
    longer = pack([*add_fields(session_id="s"), {"new": 1}, [2]])
    assert decode_add_request(longer).session_id == "s"


def test_skipped_fields_are_not_looked_at() -> None:
    # Whatever sits in the fields the coordinator does not read, as long as it is msgpack.
    payload = add_payload(
        sampling_params={"logits_processors": [Ext(1, b"pickled")], "extra_args": {"x": [1] * 50}},
        pooling_params=["embed", None, True],
        arrival_time="not even a float",
        kv_hints={"anything": [None, 1.5]},
        reasoning_parser_kwargs={"k": Ext(2, b"cloud")},
    )
    assert decode_add_request(payload).prompt_token_ids == [1, 2, 3]


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\xc1", "decode"),
        (b"", "decode"),
        (pack(add_fields()[:8]), "bad_value"),
        (pack({"request_id": "r"}), "bad_value"),
        (add_payload(prompt_token_ids=[1, -2]), "bad_value"),
        (add_payload(prompt_token_ids=[1, 1 << 32]), "bad_value"),
        (add_payload(prompt_token_ids=[1, 2.5]), "bad_value"),
        (add_payload(prompt_token_ids=[1, True]), "bad_value"),
        # The array form of a tensor: vLLM 0.33's engine refuses it as well.
        (add_payload(prompt_token_ids=["int64", [3], Ext(3, bytes(24))]), "bad_value"),
        (add_payload(data_parallel_rank=-1), "bad_value"),
        (add_payload(data_parallel_rank=65536), "bad_value"),
        (add_payload(lora_request=["name"]), "bad_value"),
        (add_payload(lora_request={"lora_name": "x", "lora_int_id": 1}), "bad_value"),
        (add_payload(mm_features=[{"identifier": "x"}]), "bad_value"),
        (add_payload(mm_features=[mm_feature("x", -1, 3)]), "bad_value"),
        (add_payload(cache_salt=7), "bad_value"),
        (add_payload(session_id="s" * 5000), "bad_value"),
        (add_payload(request_id=None), "bad_value"),
        (pack(add_fields())[:-3], "decode"),
    ],
)
def test_bad_payloads(payload: bytes, reason: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_add_request(payload)
    assert info.value.reason == reason


def test_deep_nesting_in_a_skipped_field_is_a_clear_error() -> None:
    fields = add_fields()[:9]
    deep = b"\x91" * 200_000 + b"\xc0"  # sampling_params nested 200,000 arrays deep
    payload = b"\x99" + b"".join(pack(f) for f in fields[:3]) + deep
    payload += b"".join(pack(f) for f in fields[4:])
    with pytest.raises(ProtocolError) as info:
        decode_add_request(payload)
    assert info.value.reason == "decode"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_raise_only_protocol_errors(data: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        decode_add_request(data)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_corrupted_payloads_raise_only_protocol_errors(data: Any) -> None:
    payload = bytearray(
        add_payload(
            prompt_token_ids=data.draw(st.lists(st.integers(0, 200_000), max_size=20)),
            mm_features=[mm_feature("img", 0, 4)],
            lora_request=["a", 1, "/p", None, False, False],
            session_id="s",
        )
    )
    position = data.draw(st.integers(0, len(payload) - 1))
    payload[position] = data.draw(st.integers(0, 255))
    with contextlib.suppress(ProtocolError):
        head = decode_add_request(bytes(payload))
        assert isinstance(head, AddRequestHead)
