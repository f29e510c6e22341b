"""The cheap looks at engine reports agree with the full decoder (report_peek).

The promises a batched reader relies on: `peek_engine_index` never names an
engine index other than the one the full decoder reads, and `stats_only_wave`
vouches for no frame the full decoder reads as a wave message, a message
without statistics, or coordinator-bound traffic it refuses, and gives the
wave the full decoder reads in the statistics. Both are checked
on generated `EngineCoreOutputs` arrays (valid and invalid values in every
position, short and long arrays) and on random mutations of real frames.
"""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.core.events import BadFrame
from coordinator.protocol import vllm
from coordinator.protocol.report_peek import peek_engine_index, stats_only_wave
from coordinator.server.planes.back_output import decode_frame
from tests.vllm_peers import engine_outputs, scheduler_stats, stats_report

ints = st.one_of(
    st.integers(min_value=0, max_value=300),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.sampled_from([0, 127, 128, 255, 256, 65535, 65536, 2**32 - 2, 2**32 - 1, 2**32]),
)
scalars = st.one_of(st.none(), st.booleans(), ints, st.floats(allow_nan=True),
                    st.text(max_size=4), st.binary(max_size=4))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=3), inner, max_size=3)),
    max_leaves=6)


@st.composite
def stats_maps(draw: st.DrawFn) -> Any:
    choice = draw(st.integers(0, 3))
    if choice == 0:
        return scheduler_stats(waiting=draw(st.integers(0, 50)), running=draw(st.integers(0, 50)),
                               kv_cache_usage=draw(st.floats(0, 1)), step=draw(st.integers(0, 99)))
    if choice == 1:  # malformed statistics in a sound envelope
        return {"num_running_reqs": draw(st.one_of(st.integers(-5, -1), st.text(max_size=2))),
                "kv_cache_usage": draw(st.floats(allow_nan=True))}
    if choice == 2:
        return None
    return draw(values)


@st.composite
def report_arrays(draw: st.DrawFn) -> list[Any]:
    """An `EngineCoreOutputs` array with anything (mostly plausible) in each position."""
    fields = [
        draw(st.one_of(st.integers(0, 300), st.sampled_from([65535, 65536, -1]), values)),
        draw(st.one_of(st.just([]), st.lists(values, max_size=2), values)),
        draw(stats_maps()),
        draw(st.one_of(st.floats(allow_nan=False), values)),
        draw(st.one_of(st.none(), values)),
        draw(st.one_of(st.none(), st.lists(st.text(max_size=3), max_size=2), values)),
        draw(st.one_of(st.none(), st.none(), ints, values)),
        draw(st.one_of(st.none(), st.none(), ints, values)),
        draw(st.one_of(st.none(), st.text(max_size=3), values)),
    ]
    length = draw(st.sampled_from([9, 9, 9, 0, 1, 2, 3, 5, 7, 8, 10, 12]))
    extra = draw(st.lists(values, max_size=3)) if length > 9 else []
    return (fields + extra)[:length]


def frames_from(array: list[Any], mutation: tuple[int, int] | None) -> bytes:
    buf = bytearray(msgspec.msgpack.encode(array))
    if mutation is not None and buf:
        at, byte = mutation
        buf[at % len(buf)] = byte
    return bytes(buf)


def check_promises(buf: bytes) -> None:
    event = decode_frame(buf)
    peeked = peek_engine_index(buf)
    if isinstance(event, vllm.EngineReport):
        assert peeked in (-1, event.engine_index)
    for index in {peeked, 0, 1, 255, 256, 65535}:
        wave = stats_only_wave(buf, index)
        if wave < 0:
            continue
        if isinstance(event, BadFrame):
            # Only malformed statistics (which the envelope skips) may get here.
            assert event.error.reason in ("bad_value", "decode"), event
            continue
        assert event.engine_index == index
        assert event.scheduler_stats is not None
        assert event.scheduler_stats.current_wave == wave
        assert event.wave_complete is None and event.start_wave is None


@settings(max_examples=600, deadline=None)
@given(report_arrays(), st.one_of(st.none(), st.tuples(st.integers(0, 600), st.integers(0, 255))))
def test_peeks_never_contradict_the_full_decoder(array: list[Any],
                                                 mutation: tuple[int, int] | None) -> None:
    check_promises(frames_from(array, mutation))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_peeks_never_contradict_the_full_decoder_on_random_bytes(buf: bytes) -> None:
    check_promises(buf)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 65535), st.integers(0, 10**6), st.integers(0, 2**31),
       st.integers(0, 2**32 - 1))
def test_vllm_stats_reports_are_recognised(rank: int, waiting: int, step: int,
                                           wave: int) -> None:
    """The shape vLLM sends is the one the peeks answer for, so a batch can skip it."""
    buf = vllm.encode_engine_outputs(vllm.EngineCoreOutputs(
        engine_index=rank, scheduler_stats=vllm.SchedulerStats(
            num_waiting_reqs=waiting, step_counter=step, current_wave=wave,
            kv_cache_usage=0.5), timestamp=1.5))
    assert peek_engine_index(buf) == rank
    assert stats_only_wave(buf, rank) == wave
    assert stats_only_wave(buf, (rank + 1) % 65536) == -1
    assert stats_only_wave(stats_report(rank, waiting=3, wave=7), rank) == 7


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 65535), st.integers(0, 2**32 - 2), st.booleans(), st.booleans())
def test_wave_messages_are_never_stats_only(rank: int, wave: int, complete: bool,
                                            with_stats: bool) -> None:
    stats = scheduler_stats(waiting=1) if with_stats else None
    fields: dict[str, Any] = {"wave_complete": wave} if complete else {"start_wave": wave}
    buf = engine_outputs(rank, stats=stats, **fields)
    assert peek_engine_index(buf) == rank
    assert stats_only_wave(buf, rank) == -1


def test_what_is_not_stats_only() -> None:
    assert stats_only_wave(engine_outputs(3), 3) == -1  # no statistics
    assert stats_only_wave(engine_outputs(3, stats=scheduler_stats(), outputs=[["r", []]]), 3) < 0
    assert stats_only_wave(engine_outputs(3, stats=scheduler_stats(), utility_output=[1]), 3) < 0
    assert stats_only_wave(engine_outputs(3, stats={"current_wave": -1}), 3) == -1
    assert stats_only_wave(engine_outputs(3, stats={"current_wave": 2**32}), 3) == -1
    assert stats_only_wave(engine_outputs(3, stats={"current_wave": 5}), 3) == 5
    assert stats_only_wave(b"\x93\x03\x90", 3) == -1
    assert stats_only_wave(b"", 3) == -1
    assert peek_engine_index(b"") == -1
    assert peek_engine_index(b"\x90\x00\x00") == -1  # empty array
    assert peek_engine_index(b"\x99\xcd\x01") == -1  # cut short
    assert peek_engine_index(b"\x99\xcd\x01\x00") == 256
    assert peek_engine_index(b"\x99\xcc\xff\x90") == 255
    assert peek_engine_index(b"\x99\xce\x00\x00\x00\x01") == -1  # wider than vLLM writes
    assert peek_engine_index(b"\x99\xff\x90") == -1  # negative fixint


def test_stats_only_mark_reads_the_wave_and_the_step() -> None:
    from coordinator.protocol.report_peek import stats_only_mark

    assert stats_only_mark(stats_report(2, waiting=3, wave=7, step=41), 2) == (7, 41)
    assert stats_only_mark(stats_report(2, wave=7, step=41), 3) is None
    assert stats_only_mark(engine_outputs(3), 3) is None
    assert stats_only_mark(engine_outputs(3, stats=scheduler_stats(), start_wave=1), 3) is None
    assert stats_only_mark(engine_outputs(3, stats={"step_counter": "x"}), 3) is None
    assert stats_only_mark(b"", 3) is None
