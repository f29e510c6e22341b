"""ADD payloads encoded from vLLM 0.33's own `EngineCoreRequest` and `LoRARequest`.

Both structs come unmodified from the pinned wheel (`vllm/v1/engine/__init__.py`
and `vllm/lora/request.py`, through `tools/vllm_wheel.py`), so the field
positions the decoder relies on are vLLM's. Their other imports are stand-ins:
torch, numpy and the config classes only appear in annotations, and the two
multimodal dataclasses are rebuilt with vLLM's field names and order (the
module that defines them pulls in torch).
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.protocol.engine_request import (
    LoraRef,
    MultiModalPlaceholder,
    PlaceholderRange,
    decode_add_request,
)
from tools import vllm_wheel


@dataclass(frozen=True)
class PlaceholderRangeStandIn:
    offset: int
    length: int
    is_embed: Any = None


@dataclass
class MultiModalFeatureSpecStandIn:
    data: Any
    modality: str
    identifier: str
    mm_position: PlaceholderRangeStandIn
    mm_hash: str | None = None


class SamplingParamsStandIn(msgspec.Struct, omit_defaults=True, dict=True):
    """Encodes like vLLM's SamplingParams: a map of the fields that differ from defaults."""

    n: int = 1
    temperature: float = 1.0
    max_tokens: int | None = 16
    stop: list[str] = []


def _placeholder(name: str) -> type:
    return type(name, (), {})


# What vLLM's engine package imports from the rest of vLLM (and torch, numpy).
ENGINE_STAND_INS: dict[str, dict[str, Any]] = {
    "numpy": {"ndarray": _placeholder("ndarray")},
    "torch": {"Tensor": _placeholder("Tensor")},
    "vllm.config.kv_events": {"KVEventsConfig": _placeholder("KVEventsConfig")},
    "vllm.multimodal.inputs": {"MultiModalFeatureSpec": MultiModalFeatureSpecStandIn},
    "vllm.outputs": {"RequestError": _placeholder("RequestError")},
    "vllm.pooling_params": {"PoolingParams": _placeholder("PoolingParams")},
    "vllm.sampling_params": {"SamplingParams": SamplingParamsStandIn},
    "vllm.v1.kv_hints": {"KvHintsEnvelope": _placeholder("KvHintsEnvelope")},
    "vllm.v1.metrics.stats": {
        name: _placeholder(name)
        for name in ("PrefillStats", "RequestSpecDecodeMetrics", "SchedulerStats")
    },
    "vllm.v1.outputs": {
        name: _placeholder(name)
        for name in ("LogprobsLists", "LogprobsTensors", "SamplingMaskLists")
    },
    "vllm.v1.serial_utils": {"UtilityResult": _placeholder("UtilityResult")},
}


@pytest.fixture(scope="module")
def vllm_engine() -> types.ModuleType:
    """vLLM's `vllm.v1.engine` package, with its own `LoRARequest` from `vllm.lora.request`."""
    try:
        modules = vllm_wheel.load("vllm.v1.engine", "vllm.lora.request",
                                  stand_ins=ENGINE_STAND_INS)
    except vllm_wheel.WheelUnavailable as exc:
        pytest.skip(f"vLLM {vllm_wheel.VLLM_VERSION} wheel unavailable: {exc}")
    return modules["vllm.v1.engine"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tokens=st.none() | st.lists(st.integers(0, 250_000), max_size=300),
    lora=st.none() | st.tuples(st.sampled_from(["sql", "chat-v2"]), st.integers(1, 50)),
    salt=st.none() | st.text(max_size=12),
    rank=st.none() | st.integers(0, 255),
    session=st.none() | st.text(max_size=12),
    features=st.lists(st.tuples(st.integers(0, 400), st.integers(1, 64)), max_size=3),
    wave=st.integers(0, 1000),
)
def test_fields_are_read_at_vllms_positions(
    vllm_engine: types.ModuleType,
    tokens: list[int] | None,
    lora: tuple[str, int] | None,
    salt: str | None,
    rank: int | None,
    session: str | None,
    features: list[tuple[int, int]],
    wave: int,
) -> None:
    lora_request_class = vllm_engine.LoRARequest
    request = vllm_engine.EngineCoreRequest(
        request_id="cmpl-1-0",
        prompt_token_ids=tokens,
        mm_features=[
            MultiModalFeatureSpecStandIn(
                data=None,
                modality="image",
                identifier=f"img-{index}",
                mm_position=PlaceholderRangeStandIn(offset, length),
                mm_hash=f"img-{index}",
            )
            for index, (offset, length) in enumerate(features)
        ]
        or None,
        sampling_params=SamplingParamsStandIn(temperature=0.0, max_tokens=32, stop=["</s>"]),
        pooling_params=None,
        arrival_time=1_700_000_000.5,
        lora_request=None
        if lora is None
        else lora_request_class(
            lora_name=lora[0], lora_int_id=lora[1], lora_path=f"/lora/{lora[0]}"
        ),
        cache_salt=salt,
        data_parallel_rank=rank,
        current_wave=wave,
        priority=2,
        trace_headers={"traceparent": "00-1-2-01"},
        session_id=session,
    )
    head = decode_add_request(msgspec.msgpack.encode(request))
    assert head.request_id == "cmpl-1-0"
    assert head.prompt_token_ids == tokens
    assert head.mm_features == (
        [
            MultiModalPlaceholder(f"img-{index}", PlaceholderRange(offset, length))
            for index, (offset, length) in enumerate(features)
        ]
        or None
    )
    assert head.lora_request == (
        None if lora is None else LoraRef(lora[0], lora[1], f"/lora/{lora[0]}")
    )
    assert head.cache_salt == salt
    assert head.data_parallel_rank == rank
    assert head.session_id == session
    assert not head.has_prompt_embeds
    assert head.cacheable is (tokens is not None)


# --- the simulated engines' and load generator's vLLM payloads -------------------------


@pytest.fixture(scope="module")
def vllm_real_sampling() -> dict[str, types.ModuleType]:
    """vLLM's engine package with its own SamplingParams and LoRARequest, unmodified."""
    wanted = ("vllm.v1.engine", "vllm.sampling_params", "vllm.lora.request")
    try:
        return vllm_wheel.load(*wanted, real=vllm_wheel.COORDINATOR_REAL)
    except vllm_wheel.WheelUnavailable as exc:
        pytest.skip(f"vLLM {vllm_wheel.VLLM_VERSION} wheel unavailable: {exc}")


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tokens=st.lists(st.integers(0, 250_000), max_size=300),
    max_tokens=st.integers(1, 4096),
    lora=st.none() | st.tuples(st.sampled_from(["sql", "chat-v2"]), st.integers(1, 50)),
    salt=st.none() | st.text(min_size=1, max_size=12),
    session=st.none() | st.text(max_size=12),
    client_index=st.integers(0, 7),
    wave=st.integers(0, 1000),
    rank=st.none() | st.integers(0, 63),
)
def test_the_simulated_frontends_payload_is_vllms_own_bytes(
    vllm_real_sampling: dict[str, types.ModuleType],
    tokens: list[int],
    max_tokens: int,
    lora: tuple[str, int] | None,
    salt: str | None,
    session: str | None,
    client_index: int,
    wave: int,
    rank: int | None,
) -> None:
    from coordinator.sim.request import decode_add_payload, encode_vllm_request

    engine = vllm_real_sampling["vllm.v1.engine"]
    sampling = vllm_real_sampling["vllm.sampling_params"]
    lora_request = vllm_real_sampling["vllm.lora.request"].LoRARequest
    path = None if lora is None else f"/adapters/{lora[0]}"
    theirs = engine.EngineCoreRequest(
        request_id="chat-7-a1b2",
        prompt_token_ids=tokens,
        mm_features=None,
        sampling_params=sampling.SamplingParams(
            temperature=0.0, max_tokens=max_tokens,
            output_kind=sampling.RequestOutputKind.DELTA),
        pooling_params=None,
        arrival_time=1_700_000_000.25,
        lora_request=None if lora is None else lora_request(
            lora_name=lora[0], lora_int_id=lora[1], lora_path=path),
        cache_salt=salt,
        data_parallel_rank=rank,
        client_index=client_index,
        current_wave=wave,
        external_req_id="chat-7",
        session_id=session,
    )
    ours = encode_vllm_request(
        "chat-7-a1b2", tokens, max_tokens=max_tokens, client_index=client_index,
        current_wave=wave, arrival_time=1_700_000_000.25,
        lora=None if lora is None or path is None else (lora[0], lora[1], path),
        cache_salt=salt, data_parallel_rank=rank, session_id=session,
        external_req_id="chat-7")
    assert ours == msgspec.msgpack.encode(theirs)
    # What a simulated engine reads from vLLM's bytes, and what the coordinator reads.
    work = decode_add_payload(msgspec.msgpack.encode(theirs))
    assert (work.request_id, work.client_index, work.current_wave, work.decode_steps) == (
        "chat-7-a1b2", client_index, wave, max_tokens)
    assert list(work.prompt_token_ids) == tokens and work.cacheable and work.vllm
    assert work.cache_salt == salt and work.session_id == session
    assert (work.lora is None) == (lora is None)
    if lora is not None and work.lora is not None:
        assert (work.lora.lora_name, work.lora.lora_int_id, work.lora.lora_path) == (
            lora[0], lora[1], path)
    head = decode_add_request(ours)
    assert head.prompt_token_ids == tokens and head.data_parallel_rank == rank


def test_a_simulated_engine_reads_vllms_multimodal_and_default_fields(
    vllm_real_sampling: dict[str, types.ModuleType],
) -> None:
    from coordinator.sim.request import DEFAULT_MAX_TOKENS, decode_add_payload

    engine = vllm_real_sampling["vllm.v1.engine"]
    sampling = vllm_real_sampling["vllm.sampling_params"]
    request = engine.EngineCoreRequest(
        request_id="mm-1",
        prompt_token_ids=list(range(40)),
        mm_features=[MultiModalFeatureSpecStandIn(
            data=None, modality="image", identifier="img-9",
            mm_position=PlaceholderRangeStandIn(4, 16), mm_hash="img-9")],
        sampling_params=sampling.SamplingParams(),  # max_tokens left at vLLM's default
        pooling_params=None,
        arrival_time=2.0,
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
    )
    work = decode_add_payload(msgspec.msgpack.encode(request))
    assert work.decode_steps == DEFAULT_MAX_TOKENS == sampling.SamplingParams().max_tokens
    assert work.mm_features == (MultiModalPlaceholder("img-9", PlaceholderRange(4, 16)),)
    assert (work.client_index, work.current_wave) == (0, 0)
