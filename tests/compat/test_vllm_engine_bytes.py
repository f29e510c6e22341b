"""What a stock vLLM 0.33 engine sends and expects, byte for byte, against the real process.

The engine-side messages here are hand-written hex where the protocol spec
(research/vllm_python_protocol.md, appendix A) gives them, and otherwise built
from plain dicts and lists in vLLM's field order (tests/vllm_peers.py). The
first test pins those builders to the spec's bytes, so every other test's
"exact bytes" mean vLLM's bytes.
"""

from __future__ import annotations

import struct

import zmq

from tests.conftest import CoordinatorFactory
from tests.vllm_peers import (
    ACCEPTED_REPLY,
    READY,
    RawEngine,
    RawFrontend,
    engine_outputs,
    engine_outputs_list,
    error_reply,
    full_publish,
    hello_payload,
    is_wave_publish,
    open_gate,
    pack,
    ready_response,
    scheduler_stats,
    start_dp_wave_frames,
    stats_report,
    unpack,
    wait_until,
    wave_publish,
)

Ctx = zmq.Context[zmq.Socket[bytes]]

TS = struct.pack(">d", 1234.5)  # an engine monotonic timestamp, float64 big-endian


def hexb(text: str) -> bytes:
    return bytes.fromhex(text)


def test_builders_reproduce_the_spec_bytes() -> None:
    """Appendix A of the spec, byte for byte."""
    assert hello_payload(local=True, headless=False) == (
        hexb("83 a6") + b"status" + hexb("a5") + b"HELLO" + hexb("a5") + b"local"
        + hexb("c3 a8") + b"headless" + hexb("c2")
    )
    assert engine_outputs(0, wave_complete=7, timestamp=1234.5) == (
        hexb("99 00 90 c0 cb") + TS + hexb("c0 c0 07 c0 c0")
    )
    assert len(engine_outputs(0, wave_complete=7)) == 18
    assert engine_outputs(3, start_wave=8, timestamp=1234.5) == (
        hexb("99 03 90 c0 cb") + TS + hexb("c0 c0 c0 08 c0")
    )
    stats = stats_report(1, waiting=5, running=2, kv_cache_usage=0.25, step=17, wave=4)
    assert stats.startswith(
        hexb("99 01 90 de 00 12 b0") + b"num_running_reqs" + hexb("02 b0") + b"num_waiting_reqs"
        + hexb("05")
    )
    assert hexb("ac") + b"step_counter" + hexb("11 ac") + b"current_wave" + hexb("04 ae") + (
        b"kv_cache_usage" + hexb("cb 3fd0000000000000")
    ) in stats
    assert stats.endswith(hexb("cb") + TS + hexb("c0 c0 c0 c0 c0"))
    assert len(stats) == 496  # "about 496 B"
    assert start_dp_wave_frames(4, 1) == [hexb("02"), hexb("92 04 01")]
    assert start_dp_wave_frames(4, None) == [hexb("02"), hexb("92 04 c0")]
    assert wave_publish(4, False) == hexb("93 c0 04 c2")
    assert hexb("81 a6") + b"status" + hexb("a8") + b"ACCEPTED" == ACCEPTED_REPLY
    assert error_reply("x") == (
        hexb("82 a6") + b"status" + hexb("a5") + b"ERROR" + hexb("a6") + b"reason" + hexb("a1")
        + b"x"
    )


def test_spec_report_bytes_drive_waves_and_stats(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx
) -> None:
    handle = coordinator(4, extra_args=["--heartbeat-s", "0.5"])
    engines = open_gate(zmq_ctx, handle.addresses, 4)
    front = RawFrontend(zmq_ctx, handle.addresses)
    front.subscribe_publishes()
    front.next_full_publish()

    # Engine 3 -> start_wave=8, exactly as the spec writes it.
    engines[3].report(hexb("99 03 90 c0 cb") + TS + hexb("c0 c0 c0 08 c0"))
    for engine in engines:
        assert engine.expect_publish() == [b"\x02", hexb("92 08 03")]
    buf = front.recv_publish(3.0)
    while buf is not None and not is_wave_publish(buf):
        buf = front.recv_publish(3.0)
    assert buf == hexb("93 c0 08 c3")

    # Engine 0 -> wave_complete=8: paused before wave 9.
    engines[0].report(hexb("99 00 90 c0 cb") + TS + hexb("c0 c0 08 c0 c0"))
    buf = front.recv_publish(3.0)
    while buf is not None and not is_wave_publish(buf):
        buf = front.recv_publish(3.0)
    assert buf == hexb("93 c0 09 c2")

    # Engine 1 -> the ~496-byte stats message.
    engines[1].report(stats_report(1, waiting=5, running=2, kv_cache_usage=0.25, step=17, wave=9))
    want = full_publish([(0, 0, 0.0), (5, 2, 0.25), (0, 0, 0.0), (0, 0, 0.0)], 9, False)
    wait_until(lambda: front.next_full_publish() == want, timeout=3.0, what="stats in row 1")
    assert handle.is_alive()


def test_shorter_longer_and_loosely_typed_reports_are_accepted(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx
) -> None:
    """Arrays shorter/longer than 9, unknown or missing stats keys, any int width."""
    handle = coordinator(4, extra_args=["--heartbeat-s", "0.5"])
    engines = open_gate(zmq_ctx, handle.addresses, 4)
    front = RawFrontend(zmq_ctx, handle.addresses)
    front.subscribe_publishes()
    front.next_full_publish()

    # Three elements only: [engine_index, outputs, scheduler_stats].
    engines[0].report(pack([0, [], {"num_waiting_reqs": 3, "num_running_reqs": 1,
                                    "kv_cache_usage": 0.5}]))
    # Twelve elements: extras after weight_version are ignored.
    engines[1].report(pack([*engine_outputs_list(1, stats=scheduler_stats(waiting=4)),
                            "future", 1, None]))
    # Unknown keys in the stats map, and only some of the known ones.
    engines[2].report(pack([2, [], {"brand_new_field": [1, 2], "num_running_reqs": 6,
                                    "another": {"x": 1}}]))
    # Non-minimal int widths and a float32 kv usage, as another encoder might write.
    engines[3].report(
        hexb("93 cd 00 03 90 83")
        + hexb("b0") + b"num_waiting_reqs" + hexb("ce 00 00 00 07")
        + hexb("b0") + b"num_running_reqs" + hexb("cf 00 00 00 00 00 00 00 02")
        + hexb("ae") + b"kv_cache_usage" + hexb("ca 3e 80 00 00")
    )
    rows = [(3, 1, 0.5), (4, 0, 0.0), (0, 6, 0.0), (7, 2, 0.25)]
    want = full_publish(rows, 0, False)
    wait_until(lambda: front.next_full_publish() == want, timeout=3.0,
               what=f"rows {rows}")
    # A wave message with wide ints: start_wave as uint32, engine index as uint16.
    engines[2].report(hexb("98 cd 00 02 90 c0 cb") + TS + hexb("c0 c0 c0 ce 00 00 00 05"))
    for engine in engines:
        assert engine.expect_publish() == [b"\x02", hexb("92 05 02")]
    counters = front.counters()
    assert not any(k.startswith("dropped.back_output") for k in counters), counters


def test_greetings_of_every_vintage_connect_dispatch(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx
) -> None:
    """0.33's 28-key greeting, an older empty greeting, and unknown future keys."""
    handle = coordinator(3)
    addrs = handle.addresses
    greetings = [
        pack(ready_response(0, 3, dp_stats_address=addrs["front_publish"],
                            coordinator_input_address=addrs["back_publish"],
                            coordinator_output_address=addrs["back_output"])),
        b"",
        pack({**ready_response(2, 3), "field_from_the_future": True}),
    ]
    engines = [RawEngine(zmq_ctx, addrs, r, dp_size=3) for r in range(3)]
    for engine in engines:
        engine.hello()
        engine.connect_plane()
        engine.subscribe()
    for engine, greeting in zip(engines, greetings, strict=True):
        engine.greet(greeting)
    for engine in engines:
        assert engine.expect_publish() == [READY]
        assert engine.ready("hash") is None  # vLLM reads no reply to READY
    front = RawFrontend(zmq_ctx, addrs)
    assert front.counters()["dispatch.greetings"] == 3
    # All three take requests through dispatch.
    for rank, engine in enumerate(engines):
        reply = front.submit(f"r{rank}", b"req", dp_rank=rank)
        assert reply[0] == "submitted", reply
        assert engine.recv_dispatch(3.0) == [b"\x00", b"req"]


def test_first_message_after_subscribing_is_ready_even_for_late_engines(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx
) -> None:
    """vLLM asserts the first frame on its XSUB is b"READY" (one frame, nothing else)."""
    handle = coordinator(2)
    addrs = handle.addresses
    engines = open_gate(zmq_ctx, addrs, 2)
    # Every engine disconnects (the coordinator sees the last unsubscribe, b"\x00") ...
    for engine in engines:
        engine.close()
    # ... and a restarted group subscribes again: each must get READY first.
    again = [RawEngine(zmq_ctx, addrs, r, handshake=False) for r in range(2)]
    for engine in again:
        engine.connect_plane()
        engine.subscribe()
        assert engine.expect_publish() == [READY]
    again[0].report(engine_outputs(0, start_wave=0))
    for engine in again:
        # Later subscriptions re-broadcast READY to everyone; engines skip extra ones.
        frames = engine.expect_publish()
        while frames == [READY]:
            frames = engine.expect_publish()
        assert frames == [b"\x02", hexb("92 00 00")]
    assert handle.is_alive()


def test_vllm_input_thread_can_parse_everything_on_back_publish(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx
) -> None:
    """Only READY and START_DP_WAVE ever appear on back_publish (else vLLM's thread dies)."""
    handle = coordinator(2, extra_args=["--heartbeat-s", "0.5"])
    engines = open_gate(zmq_ctx, handle.addresses, 2)
    for wave in range(3):
        engines[1].report(engine_outputs(1, start_wave=wave))
        engines[0].report(engine_outputs(0, stats=scheduler_stats(running=1, step=1, wave=wave)))
        engines[0].report(engine_outputs(0, wave_complete=wave))
    seen = []
    for engine in engines:
        while (frames := engine.recv_publish(0.3)) is not None:
            seen.append(frames)
    assert seen
    for frames in seen:
        if frames[0] == READY:
            assert frames == [READY]
            continue
        assert frames[0] in (b"\x00", b"\x01", b"\x02", b"\x03"), frames
        assert frames[0] == b"\x02" and len(frames) == 2, frames
        wave, exclude = unpack(frames[1])
        assert isinstance(wave, int) and 0 <= wave < 2**32
        assert exclude is None or isinstance(exclude, int)


def test_elastic_ep_ready_and_future_keys_are_accepted(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx
) -> None:
    """vLLM's READY with elastic EP carries three more keys; unknown keys are tolerated."""
    handle = coordinator(2, extra_args=["--coord-store-port", "29777"])
    addrs = handle.addresses
    engines = [RawEngine(zmq_ctx, addrs, r, dp_size=2) for r in range(2)]
    for engine in engines:
        engine.send_handshake(pack({"status": "HELLO", "local": False, "headless": True,
                                    "some_future_key": [1, 2, 3]}))
        init = unpack(engine.expect_handshake())
        assert init["parallel_config"]["_coord_store_port"] == 29777
        engine.init = init
        engine.connect_plane()
        engine.subscribe()
        engine.greet()
    for engine in engines:
        assert engine.expect_publish() == [READY]
    for engine in engines:
        engine.send_handshake(pack({
            "status": "READY", "local": False, "headless": True,
            "parallel_config_hash": "c0ffee",
            "coord_store_port": 29777,
            "elastic_ep_max_dp_size": 4,
            "num_redundant_experts": 0,
        }))
    front = RawFrontend(zmq_ctx, addrs)
    wait_until(lambda: [e[1] for e in front.state()["engines"]] == ["ready", "ready"],
               what="both ranks ready")
    for engine in engines:
        assert engine.recv_handshake(0.0) is None  # vLLM reads no reply to READY
