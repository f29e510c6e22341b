"""vLLM 0.33 wire formats: golden bytes, round trips, bounds, and fuzzing.

Golden bytes come from the byte-level examples of the vLLM protocol write-up
and from msgspec encoding plain dicts laid out the way vLLM 0.33's dataclasses
are (every key, in declaration order), which is how vLLM's serializer writes them.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator import protocol
from coordinator.protocol import (
    ABORT,
    ADD,
    ENGINE_CORE_DEAD,
    MAX_WAVE,
    READY,
    REQUEST_TYPES,
    START_DP_WAVE,
    SUBSCRIBE,
    UNSUBSCRIBE,
    UTILITY,
    EngineCoreOutputs,
    EngineHandshakeMetadata,
    EngineReadyResponse,
    EngineReport,
    EngineZmqAddresses,
    FrontPublish,
    HandshakeAccepted,
    HandshakeError,
    HandshakeMessage,
    IdentityError,
    LegacyFirstRequest,
    PrefixCacheStats,
    ProtocolError,
    ScaleElasticEP,
    SchedulerLoad,
    SchedulerStats,
    check_coordinator_traffic,
    decode_abort,
    decode_engine_outputs,
    decode_engine_report,
    decode_front_publish,
    decode_front_upstream,
    decode_handshake,
    decode_handshake_reply,
    decode_init,
    decode_ready_response,
    decode_start_dp_wave,
    encode_abort,
    encode_engine_outputs,
    encode_front_publish,
    encode_handshake,
    encode_handshake_accepted,
    encode_handshake_error,
    encode_handshake_reply,
    encode_init,
    encode_ready_response,
    encode_scale_elastic_ep,
    encode_start_dp_wave,
    vllm,
)

TS = 1234.5678  # a known engine timestamp
TS_BYTES = b"\xcb" + struct.pack(">d", TS)
ENC = msgspec.msgpack.encode


def h(text: str) -> bytes:
    return bytes.fromhex(text)


def s(text: str) -> bytes:
    """A msgpack fixstr (the keys and short strings in these messages)."""
    raw = text.encode()
    assert len(raw) < 32
    return bytes([0xA0 | len(raw)]) + raw


def vllm_prefix_cache_stats(**values: Any) -> dict[str, Any]:
    """vLLM 0.33 PrefixCacheStats as its dataclass encodes: 8 keys in order."""
    fields: dict[str, Any] = {
        "reset": False,
        "requests": 0,
        "queries": 0,
        "hits": 0,
        "preempted_requests": 0,
        "preempted_queries": 0,
        "preempted_hits": 0,
        "hits_by_source": {},
    }
    fields.update(values)
    return fields


def vllm_scheduler_stats(**values: Any) -> dict[str, Any]:
    """vLLM 0.33 SchedulerStats as its dataclass encodes: 18 keys in order."""
    fields: dict[str, Any] = {
        "num_running_reqs": 0,
        "num_waiting_reqs": 0,
        "num_skipped_waiting_reqs": 0,
        "num_kv_fetch_reqs_by_stage": {},
        "step_counter": 0,
        "current_wave": 0,
        "kv_cache_usage": 0.0,
        "iteration_details": None,
        "prefix_cache_stats": vllm_prefix_cache_stats(),
        "connector_prefix_cache_stats": None,
        "kv_cache_eviction_events": [],
        "spec_decoding_stats": None,
        "kv_connector_stats": None,
        "ec_connector_stats": None,
        "waiting_lora_adapters": {},
        "running_lora_adapters": {},
        "cudagraph_stats": None,
        "perf_stats": None,
    }
    assert set(values) <= set(fields)
    fields.update(values)
    return fields


def vllm_outputs(engine_index: int = 0, **values: Any) -> list[Any]:
    """vLLM 0.33 EngineCoreOutputs as an array: all 9 elements."""
    fields: dict[str, Any] = {
        "engine_index": engine_index,
        "outputs": [],
        "scheduler_stats": None,
        "timestamp": TS,
        "utility_output": None,
        "finished_requests": None,
        "wave_complete": None,
        "start_wave": None,
        "weight_version": None,
    }
    assert set(values) <= set(fields)
    fields.update(values)
    return list(fields.values())


def vllm_ready_response(**values: Any) -> dict[str, Any]:
    """vLLM 0.33 EngineCoreReadyResponse as its dataclass encodes: 28 keys in order."""
    fields: dict[str, Any] = {
        "max_model_len": 8192,
        "num_gpu_blocks": 4096,
        "block_size": 16,
        "dp_stats_address": "tcp://10.0.0.1:5555",
        "dtype": "bfloat16",
        "vllm_version": "0.33.0",
        "world_size": 8,
        "data_parallel_size": 4,
        "tensor_parallel_size": 8,
        "pipeline_parallel_size": 1,
        "decode_context_parallel_size": 1,
        "data_parallel_rank": 3,
        "max_num_seqs": 256,
        "max_num_batched_tokens": 8192,
        "instance_id": "abc123",
        "supports_lora": False,
        "max_loras": 0,
        "mamba_block_size": None,
        "kv_cache_size_tokens": 65536,
        "kv_cache_max_concurrency": 8.0,
        "kv_events_config": None,
        "weight_transfer_backend": None,
        "enable_sleep_mode": False,
        "supports_draft_weight_updates": False,
        "effective_attention_block_size": 16,
        "coord_store_port": 0,
        "coordinator_input_address": "tcp://10.0.0.1:5556",
        "coordinator_output_address": "tcp://10.0.0.1:5557",
    }
    fields.update(values)
    return fields


# --------------------------------------------------------------------- constants


def test_frame_constants() -> None:
    assert (ADD, ABORT, START_DP_WAVE, UTILITY) == (b"\x00", b"\x01", b"\x02", b"\x03")
    assert sorted(REQUEST_TYPES) == [b"\x00", b"\x01", b"\x02", b"\x03"]
    assert isinstance(REQUEST_TYPES, frozenset)
    assert READY == b"READY" == h("52 45 41 44 59")
    assert (SUBSCRIBE, UNSUBSCRIBE) == (b"\x01", b"\x00")
    assert ENGINE_CORE_DEAD == b"ENGINE_CORE_DEAD"
    assert MAX_WAVE == 2**32 - 1


def test_package_exports_every_public_name() -> None:
    from coordinator.protocol import vllm

    for name in vllm.__all__:
        assert getattr(protocol, name) is getattr(vllm, name)
        assert name in protocol.__all__


# ------------------------------------------------------------- appendix A: C2


def test_golden_wave_complete() -> None:
    wire = h("99 00 90 c0") + TS_BYTES + h("c0 c0 07 c0 c0")
    assert len(wire) == 18
    msg = decode_engine_outputs(wire)
    assert msg == EngineCoreOutputs(engine_index=0, timestamp=TS, wave_complete=7)
    assert encode_engine_outputs(msg) == wire
    report = decode_engine_report(wire)
    assert (report.engine_index, report.wave_complete, report.start_wave) == (0, 7, None)
    assert report.scheduler_stats is None
    check_coordinator_traffic(msg)
    check_coordinator_traffic(report)


def test_golden_start_wave() -> None:
    wire = h("99 03 90 c0") + TS_BYTES + h("c0 c0 c0 08 c0")
    msg = decode_engine_outputs(wire)
    assert msg == EngineCoreOutputs(engine_index=3, timestamp=TS, start_wave=8)
    assert encode_engine_outputs(msg) == wire
    report = decode_engine_report(wire)
    assert (report.engine_index, report.wave_complete, report.start_wave) == (3, None, 8)


def golden_stats_wire() -> bytes:
    return ENC(
        vllm_outputs(
            1,
            scheduler_stats=vllm_scheduler_stats(
                num_running_reqs=2,
                num_waiting_reqs=5,
                step_counter=17,
                current_wave=4,
                kv_cache_usage=0.25,
            ),
        )
    )


def test_golden_stats_message_layout() -> None:
    wire = golden_stats_wire()
    # Spot checks of the appendix row, in order.
    assert wire.startswith(
        h("99 01 90 de 00 12 b0") + b"num_running_reqs" + h("02 b0") + b"num_waiting_reqs" + h("05")
    )
    assert (
        h("ac")
        + b"step_counter"
        + h("11 ac")
        + b"current_wave"
        + h("04 ae")
        + (b"kv_cache_usage" + h("cb 3fd0000000000000"))
        in wire
    )
    assert wire.endswith(TS_BYTES + h("c0 c0 c0 c0 c0"))
    assert 480 <= len(wire) <= 520  # "about 500 bytes"


def test_full_scheduler_stats_is_byte_identical_to_vllm() -> None:
    wire = golden_stats_wire()
    ours = EngineCoreOutputs(
        engine_index=1,
        timestamp=TS,
        scheduler_stats=SchedulerStats(
            num_running_reqs=2,
            num_waiting_reqs=5,
            step_counter=17,
            current_wave=4,
            kv_cache_usage=0.25,
        ),
    )
    assert encode_engine_outputs(ours) == wire
    assert decode_engine_outputs(wire) == ours
    assert encode_engine_outputs(decode_engine_outputs(wire)) == wire
    # Positional construction follows vLLM's field order too (running, waiting).
    assert SchedulerStats(2, 5) == SchedulerStats(num_running_reqs=2, num_waiting_reqs=5)


def test_scheduler_stats_field_order_and_defaults_match_vllm() -> None:
    assert SchedulerStats.__struct_fields__ == tuple(vllm_scheduler_stats())
    assert PrefixCacheStats.__struct_fields__ == tuple(vllm_prefix_cache_stats())
    assert ENC(SchedulerStats()) == ENC(vllm_scheduler_stats())
    assert ENC(PrefixCacheStats()) == ENC(vllm_prefix_cache_stats())
    # Mutable defaults are per instance.
    first, second = SchedulerStats(), SchedulerStats()
    first.waiting_lora_adapters["a"] = 1
    first.prefix_cache_stats.hits_by_source["device"] = 1
    assert second.waiting_lora_adapters == {}
    assert second.prefix_cache_stats.hits_by_source == {}


def test_full_scheduler_stats_with_every_nested_field_set() -> None:
    iteration = {
        "iteration_index": 9,
        "num_ctx_requests": 1,
        "num_ctx_tokens": 100,
        "num_generation_requests": 3,
        "num_generation_tokens": 3,
        "elapsed_ms": 12.5,
        "num_encoder_inputs": 0,
        "num_encoder_output_tokens": 0,
        "is_dummy": False,
    }
    eviction = {"lifetime_seconds": 3.0, "idle_seconds": 1.0, "reuse_gaps_seconds": [0.5, 0.25]}
    vllm_dict = vllm_scheduler_stats(
        num_running_reqs=7,
        num_waiting_reqs=300,
        num_skipped_waiting_reqs=2,
        num_kv_fetch_reqs_by_stage={"waiting_to_start": 1, "in_progress": 2},
        step_counter=70000,
        current_wave=2**32 - 1,
        kv_cache_usage=1.0,
        iteration_details=iteration,
        prefix_cache_stats=vllm_prefix_cache_stats(
            reset=True, requests=4, queries=400, hits=128, hits_by_source={"device": 128}
        ),
        connector_prefix_cache_stats=vllm_prefix_cache_stats(requests=1, hits_by_source={}),
        kv_cache_eviction_events=[eviction],
        spec_decoding_stats={"num_spec_tokens": 3, "num_drafts": 1},
        kv_connector_stats={"nixl": {"transfers": 2}},
        ec_connector_stats={},
        waiting_lora_adapters={"sql": 1},
        running_lora_adapters={"chat": 2},
        cudagraph_stats={"captured": True},
        perf_stats={"flops": 1.5e12},
    )
    wire = ENC(vllm_outputs(5, scheduler_stats=vllm_dict, weight_version="v7"))
    ours = EngineCoreOutputs(
        engine_index=5,
        timestamp=TS,
        weight_version="v7",
        scheduler_stats=SchedulerStats(
            num_running_reqs=7,
            num_waiting_reqs=300,
            num_skipped_waiting_reqs=2,
            num_kv_fetch_reqs_by_stage={"waiting_to_start": 1, "in_progress": 2},
            step_counter=70000,
            current_wave=2**32 - 1,
            kv_cache_usage=1.0,
            iteration_details=iteration,
            prefix_cache_stats=PrefixCacheStats(
                reset=True, requests=4, queries=400, hits=128, hits_by_source={"device": 128}
            ),
            connector_prefix_cache_stats=PrefixCacheStats(requests=1),
            kv_cache_eviction_events=[eviction],
            spec_decoding_stats={"num_spec_tokens": 3, "num_drafts": 1},
            kv_connector_stats={"nixl": {"transfers": 2}},
            ec_connector_stats={},
            waiting_lora_adapters={"sql": 1},
            running_lora_adapters={"chat": 2},
            cudagraph_stats={"captured": True},
            perf_stats={"flops": 1.5e12},
        ),
    )
    assert encode_engine_outputs(ours) == wire
    decoded = decode_engine_outputs(wire)
    assert decoded == ours
    assert encode_engine_outputs(decoded) == wire
    report = decode_engine_report(wire)
    assert report.scheduler_stats == SchedulerLoad(
        num_running_reqs=7,
        num_waiting_reqs=300,
        step_counter=70000,
        current_wave=2**32 - 1,
        kv_cache_usage=1.0,
    )


def test_lean_report_reads_the_golden_stats() -> None:
    report = decode_engine_report(golden_stats_wire())
    assert report.engine_index == 1
    assert report.timestamp == TS
    assert report.scheduler_stats == SchedulerLoad(
        num_running_reqs=2, num_waiting_reqs=5, step_counter=17, current_wave=4, kv_cache_usage=0.25
    )


@pytest.mark.parametrize("decode", [decode_engine_outputs, decode_engine_report])
def test_shorter_arrays_take_defaults(decode: Callable[[bytes], Any]) -> None:
    assert decode(ENC([])).engine_index == 0
    msg = decode(ENC([2]))
    assert (msg.engine_index, msg.outputs, msg.scheduler_stats) == (2, [], None)
    msg = decode(ENC([4, [], None, TS, None, None, 9]))
    assert (msg.engine_index, msg.wave_complete, msg.start_wave) == (4, 9, None)
    msg = decode(ENC([4, [], {"num_waiting_reqs": 3}]))
    assert msg.scheduler_stats.num_waiting_reqs == 3
    assert msg.scheduler_stats.num_running_reqs == 0


@pytest.mark.parametrize("decode", [decode_engine_outputs, decode_engine_report])
def test_longer_arrays_ignore_the_extra_elements(decode: Callable[[bytes], Any]) -> None:
    wire = ENC([*vllm_outputs(6, start_wave=11), "future", {"x": [1, 2]}, 3.5])
    msg = decode(wire)
    assert (msg.engine_index, msg.start_wave, msg.wave_complete) == (6, 11, None)


def test_full_decode_of_short_array_re_encodes_with_all_nine_elements() -> None:
    msg = decode_engine_outputs(ENC([2, [], None, TS]))
    assert encode_engine_outputs(msg) == ENC(vllm_outputs(2))


@pytest.mark.parametrize("decode", [decode_engine_outputs, decode_engine_report])
def test_unknown_scheduler_stats_keys_are_ignored(decode: Callable[[bytes], Any]) -> None:
    stats = {
        "brand_new_counter": 12,
        **vllm_scheduler_stats(num_running_reqs=1, num_waiting_reqs=2, kv_cache_usage=0.5),
        "another_future_key": {"nested": [1, None]},
    }
    msg = decode(ENC(vllm_outputs(0, scheduler_stats=stats)))
    assert msg.scheduler_stats.num_running_reqs == 1
    assert msg.scheduler_stats.num_waiting_reqs == 2
    assert msg.scheduler_stats.kv_cache_usage == 0.5


@pytest.mark.parametrize("decode", [decode_engine_outputs, decode_engine_report])
def test_missing_scheduler_stats_keys_take_defaults(decode: Callable[[bytes], Any]) -> None:
    msg = decode(ENC(vllm_outputs(0, scheduler_stats={"num_waiting_reqs": 4})))
    stats = msg.scheduler_stats
    assert (stats.num_waiting_reqs, stats.num_running_reqs, stats.kv_cache_usage) == (4, 0, 0.0)
    assert (stats.step_counter, stats.current_wave) == (0, 0)


def test_lean_report_skips_stats_fields_the_coordinator_does_not_read() -> None:
    # A future engine that changes a field the coordinator never reads still
    # reports load; the full decode, which checks every field, refuses it.
    stats = vllm_scheduler_stats(num_waiting_reqs=3, prefix_cache_stats="changed shape")
    wire = ENC(vllm_outputs(1, scheduler_stats=stats))
    assert decode_engine_report(wire).scheduler_stats == SchedulerLoad(num_waiting_reqs=3)
    with pytest.raises(ProtocolError):
        decode_engine_outputs(wire)


def test_integer_kv_cache_usage_is_read_as_float() -> None:
    wire = ENC(vllm_outputs(0, scheduler_stats={"kv_cache_usage": 1}))
    for decode in (decode_engine_outputs, decode_engine_report):
        stats = decode(wire).scheduler_stats
        assert stats is not None
        usage = stats.kv_cache_usage
        assert usage == 1.0 and isinstance(usage, float)


# ---------------------------------------------------------- bounds at the edge

BAD_OUTPUT_FIELDS: list[tuple[str, Any]] = [
    ("engine_index", -1),
    ("engine_index", 65536),
    ("engine_index", 2**63),
    ("engine_index", True),
    ("engine_index", False),
    ("engine_index", 1.0),
    ("engine_index", "1"),
    ("outputs", None),
    ("wave_complete", -1),
    ("wave_complete", 2**32),
    ("wave_complete", True),
    ("wave_complete", 1.5),
    ("start_wave", -5),
    ("start_wave", 2**32),
    ("start_wave", False),
    ("start_wave", "3"),
    ("scheduler_stats", [1, 2, 3]),
    ("scheduler_stats", 7),
]


@pytest.mark.parametrize(("field", "value"), BAD_OUTPUT_FIELDS)
@pytest.mark.parametrize("decode", [decode_engine_outputs, decode_engine_report])
def test_out_of_range_or_wrongly_typed_output_fields_are_refused(
    decode: Callable[[bytes], Any], field: str, value: Any
) -> None:
    with pytest.raises(ProtocolError) as info:
        decode(ENC(vllm_outputs(**{"engine_index": 0, field: value})))
    assert info.value.reason == "bad_value"
    assert type(info.value) is ProtocolError


BAD_STATS_FIELDS: list[tuple[str, Any]] = [
    ("num_waiting_reqs", -1),
    ("num_waiting_reqs", True),
    ("num_waiting_reqs", 2.0),
    ("num_running_reqs", -3),
    ("num_running_reqs", False),
    ("step_counter", -1),
    ("step_counter", True),
    ("current_wave", -1),
    ("current_wave", 2**32),
    ("current_wave", True),
    ("kv_cache_usage", math.nan),
    ("kv_cache_usage", math.inf),
    ("kv_cache_usage", -math.inf),
    ("kv_cache_usage", -0.01),
    ("kv_cache_usage", 1.0000001),
    ("kv_cache_usage", True),
    ("kv_cache_usage", "0.5"),
    ("kv_cache_usage", None),
]


@pytest.mark.parametrize(("field", "value"), BAD_STATS_FIELDS)
@pytest.mark.parametrize("decode", [decode_engine_outputs, decode_engine_report])
def test_out_of_range_or_wrongly_typed_stats_are_refused(
    decode: Callable[[bytes], Any], field: str, value: Any
) -> None:
    wire = ENC(vllm_outputs(0, scheduler_stats=vllm_scheduler_stats(**{field: value})))
    with pytest.raises(ProtocolError) as info:
        decode(wire)
    assert info.value.reason == "bad_value"


@pytest.mark.parametrize("decode", [decode_engine_outputs, decode_engine_report])
def test_edge_values_are_accepted(decode: Callable[[bytes], Any]) -> None:
    stats = vllm_scheduler_stats(
        num_waiting_reqs=2**63 - 1, current_wave=2**32 - 1, kv_cache_usage=0.0
    )
    msg = decode(ENC(vllm_outputs(65535, scheduler_stats=stats, wave_complete=2**32 - 2,
                                  start_wave=2**32 - 1)))
    assert msg.engine_index == 65535
    assert msg.wave_complete == 2**32 - 2
    assert msg.start_wave == 2**32 - 1
    assert msg.scheduler_stats.num_waiting_reqs == 2**63 - 1


@pytest.mark.parametrize("decode", [decode_engine_outputs, decode_engine_report])
def test_last_u32_wave_cannot_complete(decode: Callable[[bytes], Any]) -> None:
    """Completing wave 2**32-1 would make the next wave 2**32, past vLLM's u32 wave."""
    with pytest.raises(ProtocolError):
        decode(ENC(vllm_outputs(0, wave_complete=2**32 - 1)))


@pytest.mark.parametrize("decode", [decode_engine_outputs, decode_engine_report])
def test_undecodable_bytes_are_a_decode_error(decode: Callable[[bytes], Any]) -> None:
    for wire in (
        b"",
        b"\xc1",
        b"\x99\x00",
        golden_stats_wire()[:-3],
        golden_stats_wire() + b"\xc0",
    ):
        with pytest.raises(ProtocolError) as info:
            decode(wire)
        assert info.value.reason == "decode"


# ------------------------------------------------------- coordinator traffic


@pytest.mark.parametrize("decode", [decode_engine_outputs, decode_engine_report])
def test_token_outputs_and_utility_results_are_not_coordinator_traffic(
    decode: Callable[[bytes], Any],
) -> None:
    with_outputs = decode(ENC(vllm_outputs(2, outputs=[["req-1", [17], None]])))
    with pytest.raises(ProtocolError, match="engine 2 sent 1 request outputs") as info:
        check_coordinator_traffic(with_outputs)
    assert info.value.reason == "not_coordinator_traffic"

    with_utility = decode(ENC(vllm_outputs(3, utility_output=[12, None, None])))
    with pytest.raises(ProtocolError, match="engine 3 sent a utility result") as info:
        check_coordinator_traffic(with_utility)
    assert info.value.reason == "not_coordinator_traffic"

    check_coordinator_traffic(decode(golden_stats_wire()))


# --------------------------------------------------------- appendix A: C3, C1


def test_golden_start_dp_wave() -> None:
    assert encode_start_dp_wave(4, 1) == [b"\x02", h("92 04 01")]
    assert encode_start_dp_wave(4, None) == [b"\x02", h("92 04 c0")]
    assert decode_start_dp_wave([b"\x02", h("92 04 01")]) == (4, 1)
    assert decode_start_dp_wave([b"\x02", h("92 04 c0")]) == (4, None)
    # Frames may arrive as any buffer.
    assert decode_start_dp_wave([memoryview(b"\x02"), bytearray(h("92 04 01"))]) == (4, 1)


def test_golden_front_publishes() -> None:
    full = h("93 92 93 00 05 cb 0000000000000000 93 01 02 cb 3fe0000000000000 03 c3")
    assert encode_front_publish([(0, 5, 0.0), (1, 2, 0.5)], 3, True) == full
    assert decode_front_publish(full) == FrontPublish([(0, 5, 0.0), (1, 2, 0.5)], 3, True)
    assert decode_front_publish(full) == ([(0, 5, 0.0), (1, 2, 0.5)], 3, True)

    wave_only = h("93 c0 04 c2")
    assert encode_front_publish(None, 4, False) == wave_only
    assert decode_front_publish(wave_only) == FrontPublish(None, 4, False)


def test_golden_scale_elastic_ep() -> None:
    wire = h("92 b0") + b"SCALE_ELASTIC_EP" + h("06")
    assert encode_scale_elastic_ep(6) == wire
    message = decode_front_upstream(wire)
    assert message == ScaleElasticEP(6)
    assert isinstance(message, ScaleElasticEP) and message.new_count == 6


def test_golden_hello() -> None:
    wire = h("83") + s("status") + s("HELLO") + s("local") + h("c3") + s("headless") + h("c2")
    assert wire == h("83 a6") + b"status" + h("a5") + b"HELLO" + h("a5") + b"local" + h(
        "c3 a8"
    ) + b"headless" + h("c2")
    assert encode_handshake(HandshakeMessage("HELLO", local=True, headless=False)) == wire
    assert decode_handshake(wire) == HandshakeMessage("HELLO", local=True, headless=False)
    assert wire == ENC({"status": "HELLO", "local": True, "headless": False})


def test_golden_identities() -> None:
    assert protocol.rank_to_identity(1) == h("01 00")
    assert protocol.rank_to_identity(258) == h("02 01")


# ------------------------------------------------------------------ handshake


def test_hello_with_both_flags_false_still_writes_them() -> None:
    wire = encode_handshake(HandshakeMessage("HELLO"))
    assert wire == ENC({"status": "HELLO", "local": False, "headless": False})


def test_ready_is_byte_identical_to_vllm() -> None:
    # dp > 1: vLLM appends the parallel config hash after headless.
    expected = ENC(
        {"status": "READY", "local": False, "headless": True, "parallel_config_hash": "9f2c"}
    )
    message = HandshakeMessage("READY", local=False, headless=True, parallel_config_hash="9f2c")
    assert encode_handshake(message) == expected
    assert decode_handshake(expected) == message
    # dp == 1: nothing after headless.
    assert encode_handshake(HandshakeMessage("READY", local=True)) == ENC(
        {"status": "READY", "local": True, "headless": False}
    )


def test_elastic_ep_ready_is_byte_identical_to_vllm() -> None:
    expected = ENC(
        {
            "status": "READY",
            "local": True,
            "headless": False,
            "parallel_config_hash": "abc",
            "coord_store_port": 29600,
            "elastic_ep_max_dp_size": 16,
            "num_redundant_experts": 0,
        }
    )
    message = HandshakeMessage(
        "READY",
        local=True,
        parallel_config_hash="abc",
        coord_store_port=29600,
        elastic_ep_max_dp_size=16,
        num_redundant_experts=0,
    )
    assert encode_handshake(message) == expected
    assert decode_handshake(expected) == message


def test_sdk_handshake_fields_come_after_the_vllm_ones() -> None:
    message = HandshakeMessage("HELLO", engine_id="engine-a", protocol_version=1)
    wire = encode_handshake(message)
    assert wire == ENC(
        {
            "status": "HELLO",
            "local": False,
            "headless": False,
            "engine_id": "engine-a",
            "protocol_version": 1,
        }
    )
    assert decode_handshake(wire) == message


def test_handshake_decoding_is_tolerant_of_unknown_and_missing_keys() -> None:
    msg = decode_handshake(ENC({"headless": True, "status": "READY", "extra": [1, 2]}))
    assert msg == HandshakeMessage("READY", local=False, headless=True)


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        ({"status": "BYE", "local": True, "headless": False}, "unknown_status"),
        ({"status": "ERROR", "reason": "x"}, "unknown_status"),
        ({"local": True, "headless": False}, "bad_value"),
        ({"status": 1, "local": True, "headless": False}, "bad_value"),
        ({"status": "HELLO", "local": 1, "headless": False}, "bad_value"),
        ({"status": "HELLO", "local": True, "headless": None}, "bad_value"),
        ({"status": "HELLO", "engine_id": ""}, "bad_value"),
        ({"status": "HELLO", "engine_id": "x" * 257}, "bad_value"),
        ({"status": "HELLO", "protocol_version": -1}, "bad_value"),
        ({"status": "READY", "coord_store_port": 70000}, "bad_value"),
        ({"status": "READY", "elastic_ep_max_dp_size": 0}, "bad_value"),
        ({"status": "READY", "num_redundant_experts": -1}, "bad_value"),
        ({"status": "READY", "parallel_config_hash": 5}, "bad_value"),
        (["HELLO", True, False], "bad_value"),
    ],
)
def test_bad_handshake_messages_are_refused(payload: Any, reason: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_handshake(ENC(payload))
    assert info.value.reason == reason


def test_unknown_status_message_is_bounded() -> None:
    with pytest.raises(ProtocolError) as info:
        decode_handshake(ENC({"status": "Z" * 10_000}))
    assert len(str(info.value)) < 200


def make_init() -> EngineHandshakeMetadata:
    return EngineHandshakeMetadata(
        addresses=EngineZmqAddresses(
            inputs=["tcp://10.0.0.1:7000", "ipc:///tmp/fe-1"],
            outputs=["tcp://10.0.0.1:7100"],
            coordinator_input="tcp://10.0.0.1:7200",
            coordinator_output="tcp://10.0.0.1:7201",
        ),
        parallel_config={
            "data_parallel_master_ip": "10.0.0.1",
            "data_parallel_master_port": 29500,
            "_data_parallel_master_port_list": [29501, 29502],
            "_coord_store_port": 0,
            "data_parallel_size": 4,
        },
    )


def test_init_is_byte_identical_to_vllm() -> None:
    expected = ENC(
        {
            "addresses": {
                "inputs": ["tcp://10.0.0.1:7000", "ipc:///tmp/fe-1"],
                "outputs": ["tcp://10.0.0.1:7100"],
                "coordinator_input": "tcp://10.0.0.1:7200",
                "coordinator_output": "tcp://10.0.0.1:7201",
                "frontend_stats_publish_address": None,
            },
            "parallel_config": {
                "data_parallel_master_ip": "10.0.0.1",
                "data_parallel_master_port": 29500,
                "_data_parallel_master_port_list": [29501, 29502],
                "_coord_store_port": 0,
                "data_parallel_size": 4,
            },
        }
    )
    assert encode_init(make_init()) == expected
    assert decode_init(expected) == make_init()
    assert decode_handshake_reply(expected) == make_init()
    assert encode_handshake_reply(make_init()) == expected


def test_init_with_empty_parallel_config_and_no_coordinator() -> None:
    meta = EngineHandshakeMetadata(EngineZmqAddresses(inputs=[], outputs=[]), parallel_config={})
    wire = encode_init(meta)
    assert wire == ENC(
        {
            "addresses": {
                "inputs": [],
                "outputs": [],
                "coordinator_input": None,
                "coordinator_output": None,
                "frontend_stats_publish_address": None,
            },
            "parallel_config": {},
        }
    )
    assert decode_init(wire) == meta


@pytest.mark.parametrize(
    "payload",
    [
        {"parallel_config": {}},
        {"addresses": {"inputs": [], "outputs": []}},
        {"addresses": {"inputs": []}, "parallel_config": {}},
        {"addresses": {"inputs": [], "outputs": []}, "parallel_config": {"x": 1.5}},
        {"addresses": {"inputs": [1], "outputs": []}, "parallel_config": {}},
    ],
)
def test_bad_init_messages_are_refused(payload: Any) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_init(ENC(payload))
    assert info.value.reason == "bad_value"


def test_error_and_accepted_replies() -> None:
    reason = "dp_rank=9 is outside this coordinator's range"
    wire = encode_handshake_error(reason)
    assert wire == ENC({"status": "ERROR", "reason": reason})
    assert encode_handshake_reply(HandshakeError(reason)) == wire
    assert decode_handshake_reply(wire) == HandshakeError(reason)

    accepted = encode_handshake_accepted()
    assert accepted == ENC({"status": "ACCEPTED"})
    assert encode_handshake_reply(HandshakeAccepted()) == accepted
    assert decode_handshake_reply(accepted) == HandshakeAccepted()


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        ({}, "unexpected_type"),
        ({"addresses": {"inputs": [], "outputs": []}}, "unexpected_type"),
        ({"parallel_config": {}}, "unexpected_type"),
        ({"status": "ERROR"}, "bad_value"),
        ({"status": "ERROR", "reason": 5}, "bad_value"),
        ({"status": "HELLO"}, "unknown_status"),
        ({"status": "READY", "local": True}, "unknown_status"),
        ([1, 2], "bad_value"),
    ],
)
def test_bad_handshake_replies_are_refused(payload: Any, reason: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_handshake_reply(ENC(payload))
    assert info.value.reason == reason


# ------------------------------------------------------------- engine greeting


def test_ready_response_is_byte_identical_to_vllm() -> None:
    expected_dict = vllm_ready_response()
    assert EngineReadyResponse.__struct_fields__ == tuple(expected_dict)
    response = EngineReadyResponse(**expected_dict)
    assert encode_ready_response(response) == ENC(expected_dict)
    assert decode_ready_response(ENC(expected_dict)) == response


def test_ready_response_decoding_is_tolerant() -> None:
    wire = ENC({"data_parallel_rank": 2, "max_model_len": 1024, "added_in_0_34": {"a": 1}})
    response = decode_ready_response(wire)
    assert response is not None
    assert (response.data_parallel_rank, response.max_model_len) == (2, 1024)
    assert response.coordinator_input_address is None
    # Older engines greet with an empty frame.
    assert decode_ready_response(b"") is None


def test_ready_response_passes_kv_events_config_through() -> None:
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": ""}
    wire = ENC(vllm_ready_response(kv_events_config=config))
    response = decode_ready_response(wire)
    assert response is not None and response.kv_events_config == config
    assert encode_ready_response(response) == wire


@pytest.mark.parametrize(
    "payload",
    [
        vllm_ready_response(data_parallel_rank=-1),
        vllm_ready_response(data_parallel_rank=65536),
        vllm_ready_response(data_parallel_rank=True),
        vllm_ready_response(max_model_len="big"),
        ["not", "a", "map"],
    ],
)
def test_bad_ready_responses_are_refused(payload: Any) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_ready_response(ENC(payload))
    assert info.value.reason == "bad_value"


# --------------------------------------------------------------- START_DP_WAVE


@settings(max_examples=200, deadline=None)
@given(
    wave=st.integers(min_value=0, max_value=MAX_WAVE),
    exclude=st.none() | st.integers(min_value=0, max_value=65535),
)
def test_start_dp_wave_round_trips(wave: int, exclude: int | None) -> None:
    frames = encode_start_dp_wave(wave, exclude)
    assert frames[0] == START_DP_WAVE and len(frames) == 2
    assert frames[1] == ENC([wave, exclude])
    assert decode_start_dp_wave(frames) == (wave, exclude)


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([], "frame_count"),
        ([b"\x02"], "frame_count"),
        ([b"\x02", h("92 04 01"), b""], "frame_count"),
        ([b"\x00", h("92 04 01")], "unexpected_type"),
        ([b"\x02\x00", h("92 04 01")], "unexpected_type"),
        ([b"\x02", h("93 04 01 02")], "bad_value"),
        ([b"\x02", h("91 04")], "bad_value"),
        ([b"\x02", ENC([-1, None])], "bad_value"),
        ([b"\x02", ENC([2**32, None])], "bad_value"),
        ([b"\x02", ENC([True, None])], "bad_value"),
        ([b"\x02", ENC([1, True])], "bad_value"),
        ([b"\x02", ENC([1, -1])], "bad_value"),
        ([b"\x02", ENC([1, 65536])], "bad_value"),
        ([b"\x02", b"\x92\x04"], "decode"),
    ],
)
def test_bad_start_dp_wave_frames_are_refused(frames: list[bytes], reason: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_start_dp_wave(frames)
    assert info.value.reason == reason


@pytest.mark.parametrize(
    ("wave", "exclude"),
    [(-1, None), (2**32, None), (True, None), (1.0, None), (0, -1), (0, 65536), (0, True)],
)
def test_start_dp_wave_encoder_refuses_values_peers_cannot_decode(wave: Any, exclude: Any) -> None:
    with pytest.raises(ValueError):
        encode_start_dp_wave(wave, exclude)


# --------------------------------------------------------------- front plane

count_rows = st.lists(
    st.tuples(
        st.integers(min_value=0, max_value=2**63 - 1),
        st.integers(min_value=0, max_value=2**63 - 1),
        st.floats(min_value=0.0, max_value=1.0),
    ),
    max_size=16,
)


@settings(max_examples=200, deadline=None)
@given(
    counts=st.none() | count_rows,
    wave=st.integers(min_value=0, max_value=MAX_WAVE),
    running=st.booleans(),
)
def test_front_publish_round_trips(
    counts: list[tuple[int, int, float]] | None, wave: int, running: bool
) -> None:
    wire = encode_front_publish(counts, wave, running)
    assert wire == ENC([None if counts is None else [list(r) for r in counts], wave, running])
    assert decode_front_publish(wire) == FrontPublish(counts, wave, running)


def test_front_publish_writes_kv_usage_as_float64_always() -> None:
    wire = encode_front_publish([(1, 2, 0), (3, 4, 1)], 0, 1)  # type: ignore[arg-type]
    assert wire == h("93 92 93 01 02 cb 0000000000000000 93 03 04 cb 3ff0000000000000 00 c3")


def test_front_publish_accepts_any_iterable_of_rows() -> None:
    rows = ((i, i + 1, 0.5) for i in range(2))
    assert encode_front_publish(rows, 1, False) == ENC([[[0, 1, 0.5], [1, 2, 0.5]], 1, False])


def test_front_publish_legacy_two_element_rows() -> None:
    wire = encode_front_publish([(0, 5, 0.0), (1, 2, 0.5)], 3, True, row_width=2)
    assert wire == h("93 92 92 00 05 92 01 02 03 c3")
    with pytest.raises(ProtocolError):
        decode_front_publish(wire)  # 0.33 front-ends cannot read these rows


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((None, -1, False), {}),
        ((None, 2**32, False), {}),
        ((None, True, False), {}),
        (([(0, 0, 0.0)], 0, False), {"row_width": 4}),
    ],
)
def test_front_publish_encoder_refuses_bad_arguments(args: Any, kwargs: Any) -> None:
    with pytest.raises(ValueError):
        encode_front_publish(*args, **kwargs)


@pytest.mark.parametrize(
    "payload",
    [
        [None, 4],
        [None, 4, False, "extra"],
        [None, -1, False],
        [None, 2**32, False],
        [None, True, False],
        [None, 4, 1],
        [[[0, 5]], 4, False],
        [[[0, 5, 0.0, 1]], 4, False],
        [[[-1, 5, 0.0]], 4, False],
        [[[0, 5, math.nan]], 4, False],
        [[[0, 5, 1.5]], 4, False],
        [[[True, 5, 0.5]], 4, False],
        {"counts": None, "wave": 4, "running": False},
    ],
)
def test_bad_front_publishes_are_refused(payload: Any) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_front_publish(ENC(payload))
    assert info.value.reason == "bad_value"


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        (["SCALE_ELASTIC_EP", 1], ScaleElasticEP(1)),
        (["SCALE_ELASTIC_EP", 65536], ScaleElasticEP(65536)),
        ([1, 3], LegacyFirstRequest(1, 3)),
        ([0, 0], LegacyFirstRequest(0, 0)),
        ([65535, 2**32 - 1], LegacyFirstRequest(65535, 2**32 - 1)),
        ([b"\x01\x00", 3], LegacyFirstRequest(1, 3, True)),  # identity bytes, as some versions sent
        ([b"\x02\x01", 0], LegacyFirstRequest(258, 0, True)),
    ],
)
def test_front_upstream_messages(payload: Any, expected: Any) -> None:
    assert decode_front_upstream(ENC(payload)) == expected


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (["SCALE_ELASTIC_EP", 0], "bad_value"),
        (["SCALE_ELASTIC_EP", -2], "bad_value"),
        (["SCALE_ELASTIC_EP", 65537], "bad_value"),
        (["SCALE_ELASTIC_EP", True], "bad_value"),
        (["SCALE_ELASTIC_EP", "6"], "bad_value"),
        (["SCALE_ELASTIC_EP"], "bad_value"),
        (["SCALE_ELASTIC_EP", 6, 7], "bad_value"),
        (["FIRST_REQ", 1], "unexpected_type"),
        ([True, 1], "unexpected_type"),
        ([None, 1], "unexpected_type"),
        ([1.0, 1], "unexpected_type"),
        ([[1], 1], "unexpected_type"),
        ([-1, 1], "bad_value"),
        ([65536, 1], "bad_value"),
        ([1, -1], "bad_value"),
        ([1, 2**32], "bad_value"),
        ([b"\x01", 1], "identity_length"),
        ({"SCALE_ELASTIC_EP": 6}, "bad_value"),
        (1, "bad_value"),
    ],
)
def test_bad_front_upstream_messages_are_refused(payload: Any, reason: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_front_upstream(ENC(payload))
    assert info.value.reason == reason


def test_identity_error_from_front_upstream_keeps_the_searchable_message() -> None:
    with pytest.raises(IdentityError, match="two-byte engine id, got b'\\\\x01\\\\x02\\\\x03'"):
        decode_front_upstream(ENC([b"\x01\x02\x03", 1]))


def test_subscription_frames_are_not_upstream_messages() -> None:
    for frame in (SUBSCRIBE, UNSUBSCRIBE):
        with pytest.raises(ProtocolError):
            decode_front_upstream(frame)


@pytest.mark.parametrize("count", [0, -1, 65537, True, 2.0])
def test_scale_encoder_refuses_bad_counts(count: Any) -> None:
    with pytest.raises(ValueError):
        encode_scale_elastic_ep(count)


# ---------------------------------------------------------------------- abort


def test_abort_round_trips() -> None:
    ids = ["cmpl-1", "cmpl-2", "ü-3"]
    wire = encode_abort(ids)
    assert wire == ENC(ids)
    assert decode_abort(wire) == ids
    assert encode_abort(iter(ids)) == wire  # any iterable of ids
    assert decode_abort(encode_abort([])) == []


@pytest.mark.parametrize("payload", [["a", 1], "a", {"a": 1}, None, [b"a"]])
def test_bad_abort_payloads_are_refused(payload: Any) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_abort(ENC(payload))
    assert info.value.reason == "bad_value"


# ---------------------------------------------------------------------- fuzz

DECODERS: dict[str, Callable[[bytes], Any]] = {
    "engine_outputs": decode_engine_outputs,
    "engine_report": decode_engine_report,
    "handshake": decode_handshake,
    "init": decode_init,
    "handshake_reply": decode_handshake_reply,
    "ready_response": decode_ready_response,
    "start_dp_wave": lambda buf: decode_start_dp_wave([START_DP_WAVE, buf]),
    "front_publish": decode_front_publish,
    "front_upstream": decode_front_upstream,
    "abort": decode_abort,
}


def only_protocol_errors(buf: bytes) -> None:
    """Run every decoder; anything but a value or ProtocolError fails the test."""
    for decode in DECODERS.values():
        try:
            decode(buf)
        except ProtocolError as exc:
            assert isinstance(exc.reason, str) and exc.reason
    # The lean report must accept everything the full decode accepts and
    # read the same values from it.
    try:
        full = decode_engine_outputs(buf)
    except ProtocolError:
        return
    lean = decode_engine_report(buf)
    assert (lean.engine_index, lean.wave_complete, lean.start_wave) == (
        full.engine_index,
        full.wave_complete,
        full.start_wave,
    )
    if full.scheduler_stats is None:
        assert lean.scheduler_stats is None
    else:
        assert lean.scheduler_stats is not None
        for name in SchedulerLoad.__struct_fields__:
            assert getattr(lean.scheduler_stats, name) == getattr(full.scheduler_stats, name)


KNOWN_KEYS = sorted(
    {
        *SchedulerStats.__struct_fields__,
        *PrefixCacheStats.__struct_fields__,
        *HandshakeMessage.__struct_fields__,
        *EngineReadyResponse.__struct_fields__,
        *EngineZmqAddresses.__struct_fields__,
        *EngineHandshakeMetadata.__struct_fields__,
        "reason",
    }
)

leaves = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.integers(min_value=-3, max_value=70000)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(["HELLO", "READY", "ERROR", "ACCEPTED", "SCALE_ELASTIC_EP"])
    | st.binary(max_size=12)
    | st.builds(
        msgspec.msgpack.Ext, st.integers(min_value=-128, max_value=127), st.binary(max_size=12)
    )
)
msgpack_values = st.recursive(
    leaves,
    lambda children: (
        st.lists(children, max_size=6)
        | st.dictionaries(st.sampled_from(KNOWN_KEYS) | st.text(max_size=8), children, max_size=6)
        | st.dictionaries(st.integers(min_value=-5, max_value=5), children, max_size=3)
    ),
    max_leaves=12,
)
# Arrays shaped like EngineCoreOutputs with random elements, and maps with
# the real keys and random values, reach deeper than arbitrary values do.
# Their elements are kept shallow so that generating them stays cheap.
shallow_values = (
    leaves
    | st.lists(leaves, max_size=3)
    | st.dictionaries(st.sampled_from(KNOWN_KEYS), leaves, max_size=3)
)
outputs_like = st.lists(shallow_values, max_size=11)
map_like = st.dictionaries(st.sampled_from(KNOWN_KEYS), shallow_values, max_size=18)
outputs_with_stats_like = st.builds(
    lambda head, stats, tail: [*head, stats, *tail],
    st.lists(shallow_values, min_size=2, max_size=2),
    map_like,
    st.lists(shallow_values, max_size=7),
)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=600))
def test_random_bytes_raise_only_protocol_errors(buf: bytes) -> None:
    only_protocol_errors(buf)


@settings(max_examples=300, deadline=None)
@given(msgpack_values)
def test_arbitrary_msgpack_raises_only_protocol_errors(value: Any) -> None:
    only_protocol_errors(ENC(value))


@settings(max_examples=300, deadline=None)
@given(outputs_like | map_like | outputs_with_stats_like)
def test_nearly_right_msgpack_raises_only_protocol_errors(value: Any) -> None:
    only_protocol_errors(ENC(value))


VALID_WIRES = [
    golden_stats_wire(),
    h("99 00 90 c0") + TS_BYTES + h("c0 c0 07 c0 c0"),
    encode_handshake(HandshakeMessage("READY", parallel_config_hash="x", coord_store_port=1)),
    encode_init(make_init()),
    encode_handshake_error("no"),
    ENC(vllm_ready_response()),
    encode_front_publish([(0, 5, 0.0), (1, 2, 0.5)], 3, True),
    encode_scale_elastic_ep(6),
    encode_abort(["a", "b"]),
]


@settings(max_examples=400, deadline=None)
@given(data=st.data(), wire=st.sampled_from(VALID_WIRES))
def test_mutated_valid_messages_raise_only_protocol_errors(
    data: st.DataObject, wire: bytes
) -> None:
    mutated = bytearray(wire)
    for _ in range(data.draw(st.integers(min_value=1, max_value=4))):
        position = data.draw(st.integers(min_value=0, max_value=len(mutated) - 1))
        mutated[position] = data.draw(st.integers(min_value=0, max_value=255))
    cut = data.draw(st.integers(min_value=0, max_value=len(mutated)))
    only_protocol_errors(bytes(mutated[:cut]))
    only_protocol_errors(bytes(mutated))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=8), max_size=4))
def test_random_start_dp_wave_frames_raise_only_protocol_errors(frames: list[bytes]) -> None:
    try:
        wave, exclude = decode_start_dp_wave(frames)
    except ProtocolError:
        return
    assert 0 <= wave <= MAX_WAVE
    assert exclude is None or 0 <= exclude <= 65535


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_deeply_nested_input_is_a_decode_error(name: str) -> None:
    for wire in (b"\x91" * 100_000 + b"\xc0", b"\x81\xa1a" * 100_000 + b"\xc0"):
        with pytest.raises(ProtocolError) as info:
            DECODERS[name](wire)
        assert info.value.reason in ("decode", "bad_value")


# ------------------------------------------------------- valid report property

stats_strategy = st.builds(
    SchedulerStats,
    num_running_reqs=st.integers(min_value=0, max_value=2**63 - 1),
    num_waiting_reqs=st.integers(min_value=0, max_value=2**63 - 1),
    step_counter=st.integers(min_value=0, max_value=2**64 - 1),
    current_wave=st.integers(min_value=0, max_value=MAX_WAVE),
    kv_cache_usage=st.floats(min_value=0.0, max_value=1.0),
    num_skipped_waiting_reqs=st.integers(min_value=0, max_value=1000),
    waiting_lora_adapters=st.dictionaries(st.text(max_size=5), st.integers(0, 9), max_size=3),
)
outputs_strategy = st.builds(
    EngineCoreOutputs,
    engine_index=st.integers(min_value=0, max_value=65535),
    scheduler_stats=st.none() | stats_strategy,
    timestamp=st.floats(allow_nan=False),
    wave_complete=st.none() | st.integers(min_value=0, max_value=MAX_WAVE - 1),
    start_wave=st.none() | st.integers(min_value=0, max_value=MAX_WAVE),
    weight_version=st.none() | st.text(max_size=8),
)


@settings(max_examples=300, deadline=None)
@given(outputs_strategy)
def test_valid_engine_outputs_round_trip_through_both_decoders(msg: EngineCoreOutputs) -> None:
    wire = encode_engine_outputs(msg)
    assert wire[0] == 0x99  # always all nine elements
    decoded = decode_engine_outputs(wire)
    assert decoded == msg
    assert encode_engine_outputs(decoded) == wire
    report = decode_engine_report(wire)
    assert isinstance(report, EngineReport)
    assert report.engine_index == msg.engine_index
    assert (report.wave_complete, report.start_wave) == (msg.wave_complete, msg.start_wave)
    if msg.scheduler_stats is None:
        assert report.scheduler_stats is None
    else:
        stats = msg.scheduler_stats
        assert report.scheduler_stats == SchedulerLoad(
            num_running_reqs=stats.num_running_reqs,
            num_waiting_reqs=stats.num_waiting_reqs,
            step_counter=stats.step_counter,
            current_wave=stats.current_wave,
            kv_cache_usage=stats.kv_cache_usage,
        )


def test_finished_request_ids_reads_finish_reasons_and_the_finished_set_once_each() -> None:
    # vLLM's EngineCoreOutput is an array: [request_id, new_token_ids, ..., finish_reason (5), ...]
    running = ["r1", [7], None, None, None, None]
    stopped = ["r2", [8], None, None, None, 1]
    message = vllm.EngineCoreOutputs(
        engine_index=0, outputs=[running, stopped, "junk", [3, [], None, None, None, 0]],
        finished_requests=["r3", "r2"],
    )
    assert vllm.finished_request_ids(message) == ["r2", "r3"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2**31), st.integers(0, 2**31),
                          st.floats(min_value=0.0, max_value=1.0)), max_size=40),
       st.integers(0, MAX_WAVE), st.booleans())
def test_publish_rows_encode_as_the_general_encoder_does(
        rows: list[tuple[int, int, float]], wave: int, running: bool) -> None:
    assert protocol.encode_front_publish_rows(rows, wave, running) == encode_front_publish(
        rows, wave, running)


def test_publish_rows_refuse_a_wave_out_of_range() -> None:
    with pytest.raises(ValueError):
        protocol.encode_front_publish_rows([], MAX_WAVE + 1, False)


def test_the_greetings_vllm_version_is_read_and_never_raises() -> None:
    from coordinator.protocol.vllm import decode_greeting_version

    greeting = encode_greeting_for_version_test("0.32.0")
    assert decode_greeting_version(greeting) == "0.32.0"
    assert decode_greeting_version(msgspec.msgpack.encode({"vllm_version": "9" * 100})) == (
        "9" * 64)
    assert decode_greeting_version(msgspec.msgpack.encode({"vllm_version": 3})) is None
    assert decode_greeting_version(msgspec.msgpack.encode({"block_size": 16})) is None
    assert decode_greeting_version(b"") is None
    assert decode_greeting_version(b"\xc1") is None


def encode_greeting_for_version_test(version: str) -> bytes:
    return msgspec.msgpack.encode({"max_model_len": 4096, "block_size": 16,
                                   "vllm_version": version, "data_parallel_rank": 1})
