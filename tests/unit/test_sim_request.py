"""The ADD payloads a simulated engine runs, and the answers it generates."""

from __future__ import annotations

import contextlib
import subprocess
import sys

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordinator.protocol.engine_request import LoraRef, decode_add_request
from coordinator.protocol.errors import ProtocolError
from coordinator.sim.request import (
    DEFAULT_MAX_TOKENS,
    SimRequest,
    SimWork,
    answer_tokens,
    decode_add_payload,
    encode_sim_request,
    encode_vllm_request,
)


def test_a_sim_request_is_read_as_before() -> None:
    payload = encode_sim_request(SimRequest("r-1", 2, 5, 7, 123))
    assert decode_add_payload(payload) == SimWork("r-1", 2, 5, 7, submitted_ns=123)


def test_a_vllm_request_gives_its_prompt_decode_length_and_cache_keys() -> None:
    payload = encode_vllm_request(
        "chat-1", [5, 6, 7, 8], max_tokens=40, client_index=3, current_wave=9,
        lora=("sql", 4, "/adapters/sql"), cache_salt="tenant-a", session_id="s-1")
    work = decode_add_payload(payload)
    assert work == SimWork(
        "chat-1", 3, 9, 40, [5, 6, 7, 8], LoraRef("sql", 4, "/adapters/sql"), (),
        "tenant-a", "s-1", cacheable=True, vllm=True)
    # The coordinator reads the same request.
    head = decode_add_request(payload)
    assert (head.request_id, head.prompt_token_ids, head.cache_salt, head.session_id) == (
        "chat-1", [5, 6, 7, 8], "tenant-a", "s-1")


def _vllm_array(**changes: object) -> list[object]:
    request: list[object] = msgspec.msgpack.decode(
        encode_vllm_request("r", [1, 2, 3], max_tokens=4))
    positions = {"sampling_params": 3, "prompt_embeds": 9, "prompt_token_ids": 1,
                 "client_index": 11}
    for name, value in changes.items():
        request[positions[name]] = value
    return request


def test_unset_max_tokens_pooling_requests_and_embeddings() -> None:
    unset = _vllm_array(sampling_params={"temperature": 0.5, "max_tokens": None})
    assert decode_add_payload(msgspec.msgpack.encode(unset)).decode_steps == DEFAULT_MAX_TOKENS
    pooling = _vllm_array(sampling_params=None)
    assert decode_add_payload(msgspec.msgpack.encode(pooling)).decode_steps == 1
    embeds = _vllm_array(prompt_embeds=b"\x00" * 16, prompt_token_ids=None)
    work = decode_add_payload(msgspec.msgpack.encode(embeds))
    assert not work.cacheable and work.prompt_token_ids == ()
    # A shorter array (vLLM leaves nothing out, but others may) reads its defaults.
    short = msgspec.msgpack.encode(_vllm_array()[:9])
    assert decode_add_payload(short).client_index == 0


@pytest.mark.parametrize(("payload", "reason"), [
    (b"\xc1", "decode"),
    (b"", "decode"),
    (msgspec.msgpack.encode(["r", 1, 2]), "bad_value"),
    (msgspec.msgpack.encode({"request_id": "r"}), "bad_value"),
    (msgspec.msgpack.encode(_vllm_array(prompt_token_ids=[-1])), "bad_value"),
    (msgspec.msgpack.encode(_vllm_array(client_index=70_000)), "bad_value"),
    (msgspec.msgpack.encode(_vllm_array(sampling_params={"max_tokens": 0})), "bad_value"),
])
def test_anything_else_is_a_protocol_error(payload: bytes, reason: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        decode_add_payload(payload)
    assert caught.value.reason == reason


@given(st.binary(max_size=64))
def test_random_bytes_never_escape_as_another_exception(data: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        decode_add_payload(data)


def test_bad_encoder_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        encode_vllm_request("r", [1], max_tokens=0)


def test_answers_depend_on_the_prompt_only_and_are_the_same_in_another_process() -> None:
    prompt = list(range(100, 300))
    answer = answer_tokens(prompt, 50)
    assert answer == answer_tokens(list(prompt), 50)
    assert answer[:10] == answer_tokens(prompt, 10)
    assert answer != answer_tokens([*prompt, 1], 50)
    assert answer != answer_tokens(prompt[1:], 50)
    assert all(1000 <= token < 32000 for token in answer)
    probe = ("from coordinator.sim.request import answer_tokens; "
             "print(answer_tokens(list(range(100, 300)), 50))")
    other = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                           timeout=20, check=True, env={"PYTHONHASHSEED": "99"}).stdout
    assert other.strip() == str(answer)
