"""FlightRecorder and WaveTimeline, driven one event at a time."""

from __future__ import annotations

import enum
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.core.observe.recorder import (
    KIND_MEMBERSHIP,
    KIND_WAVE,
    LATENCY_WINDOW,
    FlightRecorder,
    RecordedEvent,
    WaveTimeline,
    WaveTotals,
    json_safe,
    tail_window,
)


class Color(enum.Enum):
    RED = "red"


def record_wave(rec: FlightRecorder, at: float, wave: int, **detail: object) -> RecordedEvent:
    return rec.record(at=at, kind=KIND_WAVE, cause=f"event at {at}", wave=wave,
                      running=True, **detail)


# --- FlightRecorder ------------------------------------------------------------------------------


def test_record_returns_the_event_with_increasing_seq() -> None:
    rec = FlightRecorder(capacity=3)
    first = rec.record(at=1.5, kind=KIND_WAVE, cause="wave_complete(4) from rank 0", wave=5,
                       running=False, rank=0, reported=4)
    second = rec.record(at=2.0, kind=KIND_MEMBERSHIP, cause="lease expired", wave=5,
                        running=False, rank=3)
    assert first == RecordedEvent(seq=1, at=1.5, kind="wave", rank=0,
                                  cause="wave_complete(4) from rank 0", wave=5, running=False,
                                  detail={"reported": 4})
    assert second.seq == 2
    assert second.rank == 3
    assert second.detail == {}
    assert rec.recorded == 2
    assert len(rec) == 2
    assert rec.dropped == 0
    assert rec.capacity == 3


def test_ring_forgets_the_oldest_when_full() -> None:
    rec = FlightRecorder(capacity=2)
    for at in range(5):
        record_wave(rec, float(at), at)
    assert [e.seq for e in rec.tail()] == [4, 5]
    assert rec.recorded == 5
    assert rec.dropped == 3
    assert len(rec) == 2


def test_tail_limits() -> None:
    rec = FlightRecorder(capacity=10)
    assert rec.tail() == []
    for at in range(4):
        record_wave(rec, float(at), at)
    assert [e.seq for e in rec.tail(2)] == [3, 4]
    assert [e.seq for e in rec.tail(100)] == [1, 2, 3, 4]
    assert rec.tail(0) == []
    assert rec.tail(-3) == []


@pytest.mark.parametrize(("size", "n", "expected"), [
    (5, None, 5), (5, 2, 2), (5, 9, 5), (5, 0, 0), (5, -1, 0), (0, 3, 0),
])
def test_tail_window(size: int, n: int | None, expected: int) -> None:
    assert tail_window(size, n) == expected


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        FlightRecorder(capacity=0)


def test_as_json_is_serializable_and_adds_age_only_with_now() -> None:
    rec = FlightRecorder()
    rec.record(at=10.0, kind=KIND_WAVE, cause="start_wave(3) from rank 2", wave=3,
               running=True, rank=2, exclude=2, raw=b"\x02", color=Color.RED,
               ranks={3, 1}, pair=(1, 2.5), nan=float("nan"), obj=object)
    without = rec.as_json()
    assert "age_s" not in without[0]
    with_age = rec.as_json(now=12.25)
    assert with_age[0]["age_s"] == 2.25
    detail = with_age[0]["detail"]
    assert detail == {"exclude": 2, "raw": "b'\\x02'", "color": "red", "ranks": [1, 3],
                      "pair": [1, 2.5], "nan": "nan", "obj": str(object)}
    json.dumps(with_age)


def test_detail_dict_of_an_event_cannot_change_the_recorded_one_through_as_dict() -> None:
    rec = FlightRecorder()
    event = record_wave(rec, 1.0, 1, k=1)
    out = event.as_dict()
    assert isinstance(out["detail"], dict)
    out["detail"]["k"] = 2
    assert rec.tail()[0].detail == {"k": 1}


def test_json_safe_nested() -> None:
    assert json_safe({1: [None, True, {"x": frozenset({"b", "a"})}]}) == {
        "1": [None, True, {"x": ["a", "b"]}]
    }
    assert json_safe(float("inf")) == "inf"
    assert json_safe(0.5) == 0.5


def test_format_lines() -> None:
    rec = FlightRecorder(capacity=2)
    rec.record(at=1.0, kind=KIND_WAVE, cause="dropped", wave=0, running=False)
    rec.record(at=2.0, kind=KIND_WAVE, cause="wave_complete(0) from rank 0", wave=1,
               running=False, rank=0)
    rec.record(at=3.5, kind=KIND_MEMBERSHIP, cause="HELLO accepted", wave=1, running=True,
               engine_id="abc")
    lines = rec.format_lines(now=4.0)
    assert lines == [
        "flight recorder: last 2 of 3 events (1 older not shown)",
        "#2 t-2.000s [wave 1 paused] wave rank=0: wave_complete(0) from rank 0",
        "#3 t-0.500s [wave 1 running] membership: HELLO accepted engine_id=abc",
    ]
    assert rec.format_lines(5, now=4.0) == lines
    assert rec.format_lines(1, now=4.0)[0] == (
        "flight recorder: last 1 of 3 events (2 older not shown)"
    )
    fresh = FlightRecorder()
    assert fresh.format_lines(now=0.0) == ["flight recorder: last 0 of 0 events"]
    record_wave(fresh, 0.0, 0)
    assert fresh.format_lines(now=1.0)[0] == "flight recorder: last 1 of 1 events"


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(min_value=1, max_value=20),
       count=st.integers(min_value=0, max_value=60),
       n=st.one_of(st.none(), st.integers(min_value=-2, max_value=70)))
def test_keeps_exactly_the_last_capacity_events_in_order(
    capacity: int, count: int, n: int | None
) -> None:
    rec = FlightRecorder(capacity=capacity)
    for i in range(count):
        record_wave(rec, float(i), i)
    kept = rec.tail()
    expected_seqs = list(range(max(1, count - capacity + 1), count + 1))
    assert [e.seq for e in kept] == expected_seqs
    assert [e.wave for e in kept] == [s - 1 for s in expected_seqs]
    assert rec.dropped + len(rec) == rec.recorded == count
    window = tail_window(len(kept), n)
    assert rec.tail(n) == (kept[len(kept) - window:] if window else [])


# --- WaveTimeline --------------------------------------------------------------------------------


def test_timeline_accumulates_running_and_paused_time() -> None:
    tl = WaveTimeline(now=100.0)
    assert tl.totals(101.0) == WaveTotals(0, 0.0, 1.0)
    assert tl.observe(0, True, 102.0) is None  # started by an engine, no wake of ours
    assert tl.totals(105.0) == WaveTotals(1, 3.0, 2.0)
    tl.observe(0, True, 105.0)  # repeated observation changes nothing
    tl.observe(1, False, 106.0)  # wave 0 complete
    assert tl.totals(106.5) == WaveTotals(1, 4.0, 2.5)
    tl.observe(1, True, 107.0)
    tl.observe(2, True, 108.0)  # a newer wave while running counts as another start
    assert tl.totals(108.0) == WaveTotals(3, 5.0, 3.0)


def test_timeline_measures_wake_latency_once() -> None:
    tl = WaveTimeline(now=0.0, wave=3, running=False)
    tl.wake_sent(3, 10.0)
    tl.wake_sent(3, 10.5)  # the first wake of a wave is what the latency starts from
    assert tl.observe(3, False, 10.6) is None
    assert tl.observe(3, True, 10.75) == pytest.approx(0.75)
    latencies, cursor = tl.wake_latencies_since(0)
    assert latencies == [pytest.approx(0.75)] and cursor == 1
    # Reading is a query: the same cursor reads the same latencies again.
    assert tl.wake_latencies_since(0) == (latencies, 1)
    assert tl.wake_latencies_since(cursor) == ([], 1)
    tl.wake_sent(3, 11.0)  # already running this wave: nothing to time
    tl.observe(4, False, 12.0)
    assert tl.observe(4, True, 13.0) is None
    assert tl.wake_latencies_since(cursor) == ([], 1)


def test_a_reader_that_falls_behind_gets_the_newest_latencies_only() -> None:
    tl = WaveTimeline(now=0.0)
    for wave in range(LATENCY_WINDOW + 10):
        tl.wake_sent(wave, float(wave))
        tl.observe(wave, True, wave + 0.5)
        tl.observe(wave + 1, False, wave + 0.75)
    latencies, cursor = tl.wake_latencies_since(0)
    assert len(latencies) == LATENCY_WINDOW and cursor == LATENCY_WINDOW + 10
    assert latencies == [pytest.approx(0.5)] * LATENCY_WINDOW


def test_timeline_forgets_wakes_for_waves_passed_by() -> None:
    tl = WaveTimeline(now=0.0, wave=5)
    tl.wake_sent(5, 1.0)
    tl.observe(7, True, 2.0)  # an engine started a later wave; wave 5's wake is moot
    tl.observe(8, False, 3.0)
    assert tl.observe(5, True, 4.0) is None  # cannot happen in practice; proves it was dropped
    assert tl.wake_latencies_since(0) == ([], 0)


def test_timeline_ignores_a_clock_going_back() -> None:
    tl = WaveTimeline(now=10.0, running=True)
    tl.observe(0, True, 9.0)
    assert tl.totals(9.0) == WaveTotals(0, 0.0, 0.0)
    assert tl.totals(11.0) == WaveTotals(0, 1.0, 0.0)
