"""The wave plane (back_output, back_publish, front_publish) of a real coordinator process.

Raw vLLM-shaped peers only (tests/vllm_peers.py): engines PUSH `EngineCoreOutputs`
arrays and subscribe with an XSUB, a front-end XSUB reads the publishes. The
checks are on exact bytes: START_DP_WAVE is `[b"\\x02", msgpack [wave, exclude]]`,
a wave change publishes `[nil, wave, running]`, a full publish is
`[counts, wave, running]` with 3-wide rows and float64 kv usage.

As in vLLM, the wave plane needs no handshake: the startup gate counts
subscriptions on back_publish, and reports are taken for any in-range rank.
"""

from __future__ import annotations

import itertools
import math
import multiprocessing
import os
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

import pytest
import zmq

from coordinator.launch import CoordinatorHandle
from tests.conftest import TRANSPORTS, CoordinatorFactory
from tests.vllm_peers import (
    READY,
    RawEngine,
    RawFrontend,
    engine_outputs,
    flood_stats,
    full_publish,
    handshake_group,
    hello_payload,
    is_wave_publish,
    open_gate,
    pack,
    scale_elastic_ep,
    scheduler_stats,
    start_dp_wave_frames,
    stats_report,
    unpack,
    wait_until,
    wave_publish,
)

Ctx = zmq.Context[zmq.Socket[bytes]]


class WavePlane:
    """A coordinator with N gate-opened raw engines and one subscribed raw front-end."""

    def __init__(self, handle: CoordinatorHandle, ctx: Ctx, engines: int) -> None:
        self.handle = handle
        self.ctx = ctx
        self.addresses = handle.addresses
        self.engines = open_gate(ctx, self.addresses, engines)
        self.front = RawFrontend(ctx, self.addresses)
        self.front.subscribe_publishes()
        # A new front subscription gets a full publish soon; it also proves the
        # subscription is in place before the test starts counting publishes.
        self.first_publish = self.front.next_full_publish(timeout=3.0)
        self._barriers = 0

    def report(self, rank: int, payload: bytes) -> None:
        self.engines[rank].report(payload)

    def barrier(self, rank: int | RawEngine) -> None:
        """Wait until everything `rank` pushed so far has been read by the coordinator.

        Sends a message the coordinator must drop (two frames on back_output) down
        the same PUSH pipe and waits for the drop counter, which orders it after
        every earlier message from that engine.
        """
        engine = self.engines[rank] if isinstance(rank, int) else rank
        push = engine.push
        assert push is not None
        push.send_multipart([b"barrier", b"two-frames"])
        self._barriers += 1
        target = self._barriers
        wait_until(lambda: self.counters().get("dropped.back_output.frame_count", 0) >= target,
                   timeout=5.0, what="the coordinator to read a barrier")

    @property
    def barriers(self) -> int:
        return self._barriers

    def counters(self) -> dict[str, int]:
        return self.front.counters()

    def wave_state(self) -> tuple[int, bool]:
        state = self.front.state()
        return state["wave"], state["running"]

    def expect_broadcast(self, frames: list[bytes], timeout: float = 3.0) -> None:
        for engine in self.engines:
            assert engine.expect_publish(timeout) == frames

    def assert_no_broadcast(self, quiet: float = 0.15) -> None:
        for index, engine in enumerate(self.engines):
            got = engine.recv_publish(quiet if index == 0 else 0.0)
            assert got is None, f"unexpected on back_publish of rank {engine.rank}: {got!r}"

    def expect_wave_publish(self, wave: int, running: bool, timeout: float = 3.0) -> None:
        deadline = time.monotonic() + timeout
        expected = wave_publish(wave, running)
        while True:
            buf = self.front.recv_publish(max(0.0, deadline - time.monotonic()))
            assert buf is not None, f"no [nil, {wave}, {running}] within {timeout} s"
            if is_wave_publish(buf):
                assert buf == expected, (buf.hex(" "), expected.hex(" "))
                return

    def wave_publishes(self, duration: float) -> list[bytes]:
        return [buf for _, buf in self.front.drain_publishes(duration) if is_wave_publish(buf)]

    def full_publish_where(self, predicate: Any, timeout: float = 3.0) -> Any:
        """The first full publish (decoded) that satisfies `predicate`."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0, "no matching full publish"
            buf = self.front.next_full_publish(left)
            decoded = unpack(buf)
            if predicate(decoded):
                return buf, decoded


def make_plane(
    coordinator: CoordinatorFactory, ctx: Ctx, engines: int, **kwargs: Any
) -> WavePlane:
    return WavePlane(coordinator(engines, **kwargs), ctx, engines)


def assert_clean(plane: WavePlane) -> None:
    assert plane.handle.is_alive()
    counters = plane.counters()
    bad = {k: v for k, v in counters.items() if k.startswith("internal_error")}
    assert not bad, bad


# ---- lockstep waves ----------------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("order", ["complete_first", "start_first"])
def test_both_arrival_orders_end_in_the_same_state(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx, order: str, transport: str
) -> None:
    """wave_complete(W) from rank 0 and start_wave(W+1) from rank 1 race; W = 3."""
    plane = make_plane(coordinator, zmq_ctx, 3, transport=transport,
                       extra_args=["--heartbeat-s", "0.5"])
    plane.report(2, engine_outputs(2, start_wave=3))
    plane.expect_broadcast([b"\x02", b"\x92\x03\x02"])
    plane.expect_wave_publish(3, True)
    assert plane.wave_state() == (3, True)

    if order == "complete_first":
        plane.report(0, engine_outputs(0, wave_complete=3))
        plane.expect_wave_publish(4, False)
        assert bytes.fromhex("93 c0 04 c2") == wave_publish(4, False)
        plane.assert_no_broadcast()
        plane.report(1, engine_outputs(1, start_wave=4))
        plane.expect_broadcast([b"\x02", b"\x92\x04\x01"])
        plane.expect_wave_publish(4, True)
    else:
        plane.report(1, engine_outputs(1, start_wave=4))
        plane.expect_broadcast([b"\x02", b"\x92\x04\x01"])
        plane.expect_wave_publish(4, True)
        plane.report(0, engine_outputs(0, wave_complete=3))
        plane.barrier(0)
        assert plane.wave_publishes(0.15) == []
        plane.assert_no_broadcast(0.0)

    assert plane.wave_state() == (4, True)
    assert plane.counters()["waves.start_broadcasts"] == 2
    # Full publishes carry the same wave and running flag.
    _, decoded = plane.full_publish_where(lambda d: d[1] == 4)
    assert decoded[1:] == [4, True]
    assert_clean(plane)


def test_start_dp_wave_frames_match_vllm_bytes() -> None:
    """Our hand-built frames are vLLM's (spec appendix A), so exact-byte checks mean it."""
    assert start_dp_wave_frames(4, 1) == [b"\x02", bytes.fromhex("92 04 01")]
    assert start_dp_wave_frames(4, None) == [b"\x02", bytes.fromhex("92 04 c0")]
    assert wave_publish(4, False) == bytes.fromhex("93 c0 04 c2")


def test_stale_and_duplicate_reports_are_ignored(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx
) -> None:
    plane = make_plane(coordinator, zmq_ctx, 3)
    plane.report(1, engine_outputs(1, start_wave=4))
    plane.expect_broadcast(start_dp_wave_frames(4, 1))
    plane.expect_wave_publish(4, True)

    # Running in wave 4: repeats, older waves and older completions change nothing.
    plane.report(2, engine_outputs(2, start_wave=4))
    plane.report(2, engine_outputs(2, start_wave=2))
    plane.report(2, engine_outputs(2, start_wave=0))
    plane.report(0, engine_outputs(0, wave_complete=3))
    plane.report(0, engine_outputs(0, wave_complete=0))
    plane.barrier(2)
    plane.barrier(0)
    assert plane.wave_publishes(0.15) == []
    plane.assert_no_broadcast(0.0)
    assert plane.wave_state() == (4, True)

    # Paused before wave 5: a start_wave for 4 is stale, wave_complete(4) again is stale.
    plane.report(0, engine_outputs(0, wave_complete=4))
    plane.expect_wave_publish(5, False)
    plane.report(1, engine_outputs(1, start_wave=4))
    plane.report(0, engine_outputs(0, wave_complete=4))
    plane.barrier(1)
    plane.barrier(0)
    assert plane.wave_publishes(0.15) == []
    plane.assert_no_broadcast(0.0)
    assert plane.wave_state() == (5, False)

    # wave_complete is read first: a message carrying both ignores start_wave (as vLLM).
    plane.report(0, engine_outputs(0, wave_complete=5, start_wave=6))
    plane.expect_wave_publish(6, False)
    plane.assert_no_broadcast()
    assert plane.wave_state() == (6, False)
    assert plane.counters()["waves.start_broadcasts"] == 1
    assert_clean(plane)


def test_nothing_but_ready_reaches_an_engine_before_the_gate_opens(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx
) -> None:
    """A vLLM engine asserts that its first back_publish frame is b"READY".

    vLLM's coordinator reads no engine reports until every engine subscribed, so a
    start_wave pushed during start-up (e.g. by an engine of a previous group still
    running against a restarted coordinator) can never overtake READY.
    """
    handle = coordinator(2)
    waiting = RawEngine(zmq_ctx, handle.addresses, 0, handshake=False)
    waiting.connect_plane()
    waiting.subscribe()
    early = RawEngine(zmq_ctx, handle.addresses, 1, handshake=False)
    early.connect_plane()
    early.report(engine_outputs(1, start_wave=0))
    early.report(engine_outputs(0, wave_complete=0))
    early.report(engine_outputs(1, start_wave=1))
    got_before_gate = waiting.recv_publish(0.4)
    early.subscribe()
    first = got_before_gate or waiting.expect_publish()
    assert first == [READY], (
        f"first frame on back_publish was {first!r}: a vLLM engine dies on anything but READY"
    )
    assert handle.is_alive()


def test_wave_at_the_u32_limit_never_kills_the_process(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx
) -> None:
    """wave_complete(2**32 - 1) is in range at the edge but makes the next wave 2**32.

    vLLM's Rust front-end decodes the wave as u32, so the coordinator must never
    publish 2**32; and no engine report may stop the process (DESIGN rule 7).
    """
    plane = make_plane(coordinator, zmq_ctx, 2, extra_args=["--heartbeat-s", "0.5"])
    top = 2**32 - 1
    plane.report(1, engine_outputs(1, start_wave=top))
    plane.expect_broadcast([b"\x02", b"\x92\xce\xff\xff\xff\xff\x01"])
    plane.expect_wave_publish(top, True)
    plane.report(0, engine_outputs(0, wave_complete=top))
    plane.barrier(0)
    plane.report(1, stats_report(1, waiting=3, running=1, step=1, wave=top))
    # Stats keep flowing and every publish stays decodable as (counts, u32, bool).
    _, decoded = plane.full_publish_where(lambda d: d[0][1] == [3, 1, 0.0])
    assert 0 <= decoded[1] <= top
    wave, _ = plane.wave_state()
    assert 0 <= wave <= top
    assert plane.handle.is_alive()
    assert_clean(plane)


# ---- stats and the load table --------------------------------------------------------------


@pytest.mark.parametrize("lockstep", [True, False], ids=["lockstep", "dense"])
def test_stats_from_rank_i_land_in_row_i(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx, lockstep: bool
) -> None:
    plane = make_plane(coordinator, zmq_ctx, 4, lockstep=lockstep)
    zero = [(0, 0, 0.0)] * 4
    assert plane.first_publish == full_publish(zero, 0, False)

    plane.report(2, stats_report(2, waiting=12, running=2, kv_cache_usage=0.25, step=1))
    rows = list(zero)
    rows[2] = (12, 2, 0.25)
    buf = plane.front.next_full_publish()
    assert buf == full_publish(rows, 0, False), buf.hex(" ")
    # Byte layout: fixarray(3), fixarray(4) of fixarray(3) rows, kv always float64 (0xcb).
    assert buf[:2] == b"\x93\x94"
    assert buf.count(b"\x93") >= 5
    decoded = unpack(buf)
    assert all(len(row) == 3 and type(row[2]) is float for row in decoded[0])

    for rank in range(4):
        plane.report(rank, stats_report(rank, waiting=rank + 1, running=10 * rank,
                                        kv_cache_usage=rank / 8, step=2))
    rows = [(rank + 1, 10 * rank, rank / 8) for rank in range(4)]
    want = full_publish(rows, 0, False)
    got, _ = plane.full_publish_where(lambda d: d[0] == [list(r) for r in rows])
    assert got == want
    state = plane.front.state()
    assert [(e[3], e[4], e[5]) for e in state["engines"]] == rows
    assert_clean(plane)


@pytest.mark.parametrize("lockstep", [True, False], ids=["lockstep", "dense"])
def test_step_snapshot_is_published_before_current_counts(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx, lockstep: bool
) -> None:
    """Spec 4.9's trace: a newer (wave, step) snapshots the last complete step first.

    Each rank reports once per step here, as a lockstep engine does, so no report can
    be superseded by a newer one of its own engine when they are read in one batch.
    """
    plane = make_plane(coordinator, zmq_ctx, 3, lockstep=lockstep)
    if lockstep:
        plane.report(1, engine_outputs(1, start_wave=0))
        plane.expect_wave_publish(0, True)
    running = lockstep
    push = plane.engines[0].push
    assert push is not None
    # Make a publish go out now; the next one is then ~100 ms away.
    push.send(stats_report(1, step=0))
    plane.front.next_full_publish()
    # One pipe, so the three arrive in this order and well inside one interval.
    push.send(stats_report(0, waiting=2, running=1, kv_cache_usage=0.1, step=1))
    push.send(stats_report(1, waiting=0, running=3, step=1))
    push.send(stats_report(2, waiting=5, running=5, step=2))
    current = full_publish([(2, 1, 0.1), (0, 3, 0.0), (5, 5, 0.0)], 0, running)
    step1 = full_publish([(2, 1, 0.1), (0, 3, 0.0), (0, 0, 0.0)], 0, running)
    first = plane.front.next_full_publish()
    if lockstep:
        assert first == step1, unpack(first)
        assert plane.front.next_full_publish() == current
    else:
        assert first == current, unpack(first)
    # Per engine marks (vLLM PR 52936): rank 1 reporting step 1 after rank 2's step 2
    # is not stale; rank 2 going back to step 1 is, and its counts still apply.
    push.send(stats_report(1, waiting=1, running=3, step=1))
    push.send(stats_report(2, waiting=7, running=0, step=1))
    plane.barrier(0)
    if lockstep:  # dense engines always send step 0, so staleness means nothing there
        counters = plane.counters()
        assert counters.get("stats.stale", 0) == 1, counters
    want = full_publish([(2, 1, 0.1), (1, 3, 0.0), (7, 0, 0.0)], 0, running)
    plane.full_publish_where(lambda d: d[0] == unpack(want)[0])
    assert_clean(plane)


def test_an_engines_report_superseded_in_one_read_still_makes_its_step_snapshot(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx
) -> None:
    """Step 1 of engine 0, step 1 of engine 1, step 2 of engine 0, on one pipe: they
    are read in one batch, where engine 0's first report is superseded by its second.
    Its counts are still what the step-1 snapshot (published first) holds."""
    plane = make_plane(coordinator, zmq_ctx, 2, lockstep=True)
    plane.report(1, engine_outputs(1, start_wave=0))
    plane.expect_wave_publish(0, True)
    push = plane.engines[0].push
    assert push is not None
    push.send(stats_report(1, step=0))
    plane.front.next_full_publish()
    push.send(stats_report(0, waiting=2, running=1, step=1))
    push.send(stats_report(1, waiting=3, running=0, step=1))
    push.send(stats_report(0, waiting=9, running=4, step=2))
    step1 = full_publish([(2, 1, 0.0), (3, 0, 0.0)], 0, True)
    current = full_publish([(9, 4, 0.0), (3, 0, 0.0)], 0, True)
    first = plane.front.next_full_publish()
    assert first == step1, unpack(first)
    assert plane.front.next_full_publish() == current
    assert_clean(plane)


BAD_REPORTS: list[tuple[str, bytes]] = [
    ("rank_out_of_range", stats_report(4, waiting=99)),  # engine_index >= N
    ("rank_out_of_range", engine_outputs(5, start_wave=9)),
    ("bad_value", stats_report(-1, waiting=99)),  # negative index (Python would wrap)
    ("bad_value", stats_report(65536, waiting=99)),  # beyond a two-byte rank
    ("bad_value", stats_report(2**63, waiting=99)),
    ("bad_value", engine_outputs(1, stats=scheduler_stats(waiting=-5))),
    ("bad_value", engine_outputs(1, stats=scheduler_stats(running=-1))),
    ("bad_value", engine_outputs(1, stats=scheduler_stats(waiting=99, kv_cache_usage=1.5))),
    ("bad_value", engine_outputs(1, stats=scheduler_stats(waiting=99, kv_cache_usage=-0.1))),
    ("bad_value", engine_outputs(1, stats=scheduler_stats(waiting=9, kv_cache_usage=math.nan))),
    ("bad_value", engine_outputs(1, stats=scheduler_stats(waiting=9, kv_cache_usage=math.inf))),
    ("bad_value", engine_outputs(1, stats=scheduler_stats(waiting=99, wave=-1))),
    ("bad_value", engine_outputs(1, stats=scheduler_stats(waiting=99, step=-1))),
    ("bad_value", engine_outputs(0, wave_complete=-1)),
    ("bad_value", engine_outputs(0, wave_complete=2**32)),
    ("bad_value", engine_outputs(1, start_wave=2**32)),
    ("bad_value", engine_outputs(1, start_wave=-7)),
    ("bad_value", engine_outputs(1, start_wave="7")),
    ("bad_value", engine_outputs(True, start_wave=7)),  # type: ignore[arg-type]
    # Good stats with a bad wave field: the whole message goes, stats included.
    ("bad_value", engine_outputs(1, stats=scheduler_stats(waiting=99), wave_complete=-2)),
    ("not_coordinator_traffic", engine_outputs(1, outputs=[["req", [1, 2]]], start_wave=9)),
    ("not_coordinator_traffic", engine_outputs(1, utility_output=[0, 1, None], start_wave=9)),
]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_bad_reports_are_dropped_counted_and_change_nothing(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx, transport: str
) -> None:
    plane = make_plane(coordinator, zmq_ctx, 4, transport=transport)
    plane.report(1, stats_report(1, waiting=3, running=1, kv_cache_usage=0.5, step=1))
    plane.report(1, engine_outputs(1, start_wave=2))
    plane.expect_broadcast(start_dp_wave_frames(2, 1))
    plane.expect_wave_publish(2, True)
    rows = [(0, 0, 0.0), (3, 1, 0.5), (0, 0, 0.0), (0, 0, 0.0)]
    plane.full_publish_where(lambda d: d[0] == [list(r) for r in rows])
    before = plane.front.state()

    for _, payload in BAD_REPORTS:
        plane.report(1, payload)
    plane.barrier(1)
    assert plane.wave_publishes(0.15) == []
    plane.assert_no_broadcast(0.0)

    after = plane.front.state()
    assert (after["wave"], after["running"]) == (before["wave"], before["running"]) == (2, True)
    assert [e[3:6] for e in after["engines"]] == [list(r) for r in rows]
    counters = after["counters"]
    expected: dict[str, int] = {}
    for reason, _ in BAD_REPORTS:
        key = f"dropped.back_output.{reason}"
        expected[key] = expected.get(key, 0) + 1
    expected["dropped.back_output.frame_count"] = plane.barriers
    got = {k: v for k, v in counters.items() if k.startswith("dropped.back_output.")}
    assert got == expected
    assert counters["waves.start_broadcasts"] == 1
    # Boundary values are fine: kv usage exactly 0.0 and 1.0, rank N-1.
    plane.report(3, stats_report(3, waiting=1, running=1, kv_cache_usage=1.0, step=1))
    rows[3] = (1, 1, 1.0)
    plane.full_publish_where(lambda d: d[0] == [list(r) for r in rows])
    assert_clean(plane)


def test_scale_elastic_ep_grows_and_shrinks_the_table(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx
) -> None:
    plane = make_plane(coordinator, zmq_ctx, 2,
                       extra_args=["--min-engines", "1", "--max-engines", "6"])
    assert scale_elastic_ep(6) == b"\x92\xb0SCALE_ELASTIC_EP\x06"  # spec appendix A
    plane.report(0, engine_outputs(0, start_wave=1))
    plane.expect_wave_publish(1, True)
    plane.expect_broadcast(start_dp_wave_frames(1, 0))

    # Before the resize, rank 3 is out of range and its stats are dropped.
    late = RawEngine(zmq_ctx, plane.addresses, 3, handshake=False)
    late.connect_plane()
    late.report(stats_report(3, waiting=7, running=7, step=1))
    plane.barrier(late)

    plane.front.send_upstream(scale_elastic_ep(4))
    _, decoded = plane.full_publish_where(lambda d: len(d[0]) == 4)
    assert decoded == [[[0, 0, 0.0]] * 4, 1, True]  # wave and running unchanged
    # A late engine's subscription is answered with READY (to every subscriber).
    late.subscribe()
    assert late.expect_publish() == [READY]
    for engine in plane.engines:
        assert engine.expect_publish() == [READY]
    late.report(stats_report(3, waiting=5, running=1, kv_cache_usage=0.75, step=2))
    _, decoded = plane.full_publish_where(lambda d: d[0][3] == [5, 1, 0.75])
    assert decoded[0][:3] == [[0, 0, 0.0]] * 3
    assert plane.front.state()["rank_count"] == 4

    plane.front.send_upstream(scale_elastic_ep(1))
    _, decoded = plane.full_publish_where(lambda d: len(d[0]) == 1)
    assert decoded[1:] == [1, True]
    plane.report(1, stats_report(1, waiting=4, step=3))  # rank 1 is gone now
    plane.barrier(1)
    counters = plane.counters()
    assert counters["dropped.back_output.rank_out_of_range"] == 2
    assert plane.front.state()["rank_count"] == 1
    assert_clean(plane)
    late.close()


def test_dense_mode_has_no_waves(coordinator: CoordinatorFactory, zmq_ctx: Ctx) -> None:
    plane = make_plane(coordinator, zmq_ctx, 2, lockstep=False)
    assert plane.first_publish == full_publish([(0, 0, 0.0)] * 2, 0, False)
    plane.report(1, engine_outputs(1, start_wave=0))
    plane.report(1, engine_outputs(1, start_wave=5))
    plane.report(0, engine_outputs(0, wave_complete=0))
    plane.report(0, engine_outputs(0, wave_complete=9))
    plane.report(1, stats_report(1, waiting=2, running=3, kv_cache_usage=0.5))
    plane.barrier(0)
    plane.barrier(1)
    publishes = [buf for _, buf in plane.front.drain_publishes(0.4)]
    assert publishes, "stats must still be published in dense mode"
    assert not any(is_wave_publish(buf) for buf in publishes)
    assert publishes[-1] == full_publish([(0, 0, 0.0), (2, 3, 0.5)], 0, False)
    plane.assert_no_broadcast(0.0)
    assert plane.wave_state() == (0, False)
    assert "waves.start_broadcasts" not in plane.counters()
    assert_clean(plane)


def test_dense_mode_dispatch_never_wakes(coordinator: CoordinatorFactory, zmq_ctx: Ctx) -> None:
    """Requests submitted through the coordinator in dense mode wake nobody."""
    handle = coordinator(2, lockstep=False)
    peers = handshake_group(zmq_ctx, handle.addresses, [0, 1], dp_size=2, parallel_config_hash=None)
    front = RawFrontend(zmq_ctx, handle.addresses)
    for i in range(4):
        reply = front.submit(f"dense-{i}", b"req", wave=0)
        assert reply[0] == "submitted" and reply[4] is False, reply
    received = 0
    for peer in peers:
        while (frames := peer.recv_dispatch(0.2)) is not None:
            assert frames == [b"\x00", b"req"]
            received += 1
        assert peer.recv_publish(0.0) is None
    assert received == 4
    state = front.state()
    assert (state["wave"], state["running"]) == (0, False)
    assert "waves.start_broadcasts" not in state["counters"]


# ---- publish cadence ----------------------------------------------------------------------


def full_publish_times(samples: Sequence[tuple[float, bytes]]) -> list[float]:
    return [t for t, buf in samples if not is_wave_publish(buf)]


def gaps(times: Sequence[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


def test_full_publishes_every_interval_while_stats_change(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx
) -> None:
    plane = make_plane(coordinator, zmq_ctx, 2)
    samples: list[tuple[float, bytes]] = []
    window = 1.2
    start = time.monotonic()
    step = 0
    while time.monotonic() < start + window:
        step += 1
        plane.report(step % 2, stats_report(step % 2, waiting=step, running=1, step=step))
        samples += plane.front.drain_publishes(0.02)
    times = full_publish_times(samples)
    g = gaps(times)
    assert len(g) >= 7, g
    assert 0.08 <= statistics.median(g) <= 0.16, g
    # "At most every 100 ms", counted rather than timed so that scheduling jitter in
    # this process cannot fake a short gap: at most one publish per interval (+ edges).
    assert len(times) <= window / 0.1 + 2, g
    assert max(g) <= 0.4, g


def test_heartbeat_when_idle(coordinator: CoordinatorFactory, zmq_ctx: Ctx) -> None:
    plane = make_plane(coordinator, zmq_ctx, 2, extra_args=["--heartbeat-s", "0.5"])
    samples = plane.front.drain_publishes(1.8)
    times = full_publish_times(samples)
    # The subscription publish came just before; heartbeats follow every 0.5 s.
    assert 3 <= len(times) <= 4, times
    assert 0.4 <= statistics.median(gaps(times)) <= 0.7, gaps(times)
    assert min(gaps(times)) >= 0.25, gaps(times)  # nothing on the 100 ms "changed" cadence
    # Idle heartbeats repeat the same bytes.
    assert {buf for _, buf in samples} == {full_publish([(0, 0, 0.0)] * 2, 0, False)}


def test_publishes_keep_their_cadence_under_a_stats_flood(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx
) -> None:
    """vLLM 0.33 starves periodic publishes under busy input; here the schedule holds."""
    plane = make_plane(coordinator, zmq_ctx, 2)
    spawn = multiprocessing.get_context("spawn")
    sent = spawn.Value("q", 0)
    flooder = spawn.Process(
        target=flood_stats, args=(plane.addresses["back_output"], 1, 2.0, sent), daemon=True
    )
    flooder.start()
    try:
        # Wait until the flood is visibly arriving, then measure for ~1.5 s of it.
        plane.full_publish_where(lambda d: d[0][1] != [0, 0, 0.0], timeout=10.0)
        samples = plane.front.drain_publishes(1.5)
    finally:
        flooder.join(10.0)
        if flooder.is_alive():
            flooder.kill()
    assert sent.value > 10_000, sent.value
    # The flood really was arriving while we measured: rank 1's row kept changing.
    rank1_rows = {tuple(unpack(buf)[0][1]) for _, buf in samples if not is_wave_publish(buf)}
    assert len(rank1_rows) >= 3, rank1_rows
    g = gaps(full_publish_times(samples))
    assert len(g) >= 8, g
    assert 0.08 <= statistics.median(g) <= 0.2, g
    assert max(g) <= 0.5, g
    assert plane.handle.is_alive()
    assert_clean(plane)


# ---- garbage on every socket ----------------------------------------------------------------


def random_blobs(rng: random.Random, count: int, *, avoid_first: bytes = b"") -> list[bytes]:
    blobs = []
    while len(blobs) < count:
        blob = rng.randbytes(rng.randint(1, 64))
        if blob[:1] not in avoid_first:
            blobs.append(blob)
    return blobs


WRONG_SHAPES = [
    pack({"a": 1}),
    pack([]),
    pack(["x", "y", "z"]),
    pack([[[[[[[[[[1]]]]]]]]]]),
    pack(None),
    pack(1.5),
    pack("READY"),
    pack([0, "not-a-list"]),
    pack([0, [], "not-stats"]),
    pack([0, [], {"num_running_reqs": "many"}]),
    b"\x91" * 5000 + b"\xc0",  # deeply nested arrays
    b"\xdd\xff\xff\xff\xff",  # array32 header claiming 4G elements, no body
]


def send_garbage(ctx: Ctx, addresses: dict[str, str], target: str, rng: random.Random) -> None:
    """Random bytes, wrong frame counts and well-formed msgpack of the wrong shape."""
    blobs = random_blobs(rng, 40)
    if target == "handshake":
        for ident in (b"\x00\x00", b"\x01\x00", b"\x09", b"longer-identity"):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, ident)
            sock.connect(addresses["handshake"])
            for payload in [*blobs[:10], *WRONG_SHAPES]:
                sock.send(payload)
            sock.send_multipart([hello_payload(), b"extra"])
            sock.send_multipart([b"a", b"b", b"c"])
            time.sleep(0.05)
            sock.close(0)
    elif target == "dispatch":
        for ident in (b"\x00\x00", b"\x05\x00", b"\xff\xff", b"\x01", b"xyz"):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, ident)
            sock.connect(addresses["dispatch"])
            for payload in [*blobs[:10], *WRONG_SHAPES]:
                sock.send(payload)
            sock.send_multipart([b"\x00", b"x", b"y"])
            time.sleep(0.05)
            sock.close(0)
    elif target == "back_output":
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(addresses["back_output"])
        for payload in [*blobs, *WRONG_SHAPES, b""]:
            sock.send(payload)
        sock.send_multipart([engine_outputs(0, start_wave=1), b"extra"])
        sock.close()
        # Over the coordinator's message size limit: libzmq drops that connection.
        huge = ctx.socket(zmq.PUSH)
        huge.setsockopt(zmq.LINGER, 1000)
        huge.connect(addresses["back_output"])
        huge.send(b"\x99" + b"\x00" * (17 * 1024 * 1024))
        huge.close()
    elif target == "back_publish":
        sock = ctx.socket(zmq.XSUB)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(addresses["back_publish"])
        # Not subscriptions (first byte 0/1 would make libzmq treat them as such) ...
        for payload in [*random_blobs(rng, 30, avoid_first=b"\x00\x01"), *WRONG_SHAPES[:3]]:
            sock.send(payload)
        # ... and subscriptions to topics other than "everything" (must not open the gate).
        sock.send(b"\x01topic")
        sock.send(b"\x01\x01")
        sock.send_multipart([b"\x07multi", b"frame"])
        time.sleep(0.05)
        sock.close()
    elif target == "front_publish":
        sock = ctx.socket(zmq.XSUB)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(addresses["front_publish"])
        for payload in [
            *random_blobs(rng, 30, avoid_first=b"\x00\x01"),
            *WRONG_SHAPES,
            pack(["SCALE_ELASTIC_EP", 0]),
            pack(["SCALE_ELASTIC_EP", -3]),
            pack(["SCALE_ELASTIC_EP", "four"]),
            pack(["SCALE_ELASTIC_EP", 2**40]),
            pack(["SCALE_ELASTIC_EP"]),
            pack(["NOT_A_COMMAND", 1]),
            pack([0, 3]),  # pre-0.33 FIRST_REQ: ignored with --frontend-wake ignore
            pack([b"\x01\x00", 3]),
            pack([1.5, 2]),
        ]:
            sock.send(payload)
        sock.send_multipart([b"\x07multi", b"frame"])
        time.sleep(0.05)
        sock.close()
    elif target == "frontend":
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(addresses["frontend"])
        for payload in [
            *blobs,
            *WRONG_SHAPES,
            b"",
            pack(["state"]),
            pack(["state", -1]),
            pack(["register", "x", "y", "z"]),
            pack(["register", 1, 99999, "ipc:///x"]),
            pack(["submit", 1, "r1", 0]),  # no payload frame
            pack(["admin", 1, "explode", 0]),
            pack(["finished", "not-a-list"]),
        ]:
            sock.send(payload)
        sock.send_multipart([pack(["state", 5]), b"unexpected payload"])
        time.sleep(0.1)
        sock.close(0)
    else:
        raise ValueError(target)


SOCKETS = ["handshake", "dispatch", "back_output", "back_publish", "front_publish", "frontend"]


@pytest.mark.parametrize("target", SOCKETS)
def test_garbage_never_kills_the_process(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx, target: str
) -> None:
    engines = 2
    # The pre-0.33 wakes among the front_publish messages are valid input, honoured by
    # default (tests/compat/test_legacy_mode.py); here they must change nothing.
    extra = ["--frontend-wake", "ignore"] if target == "front_publish" else []
    handle = coordinator(engines, transport="tcp" if target in ("handshake", "frontend") else "ipc",
                         extra_args=extra)
    addrs = handle.addresses
    rng = random.Random(hash(target) & 0xFFFF)
    send_garbage(zmq_ctx, addrs, target, rng)

    front = RawFrontend(zmq_ctx, addrs)
    counters = wait_until(
        lambda: (c := front.counters()) and any(
            k.startswith(("dropped.", "refused.")) for k in c
        ) and c,
        timeout=5.0, what="the garbage to be counted",
    )
    assert handle.is_alive()
    assert not {k for k in counters if k.startswith("internal_error")}, counters

    # A clean group still starts up and runs a wave.
    peers = handshake_group(zmq_ctx, addrs, list(range(engines)), dp_size=engines,
                            rng=random.Random(5))
    front.subscribe_publishes()
    first = front.next_full_publish()
    assert unpack(first)[0] == [[0, 0, 0.0]] * engines, "garbage changed the load table"
    peers[1].report(engine_outputs(1, start_wave=0))
    for peer in peers:
        assert peer.expect_publish() == start_dp_wave_frames(0, 1)
    deadline = time.monotonic() + 3
    while True:
        buf = front.recv_publish(max(0.0, deadline - time.monotonic()))
        assert buf is not None, "no wave publish after garbage"
        if is_wave_publish(buf):
            assert buf == wave_publish(0, True)
            break
    state = front.state()
    assert (state["wave"], state["running"]) == (0, True)
    assert [e[1] for e in state["engines"]] == ["ready"] * engines
    assert not {k for k in state["counters"] if k.startswith("internal_error")}, state
    assert handle.is_alive()
    # And it still stops cleanly: exit 0, ipc socket files removed.
    front.close()
    for peer in peers:
        peer.close()
    assert handle.shutdown(timeout=5.0) == 0
    for address in addrs.values():
        if address.startswith("ipc://"):
            assert not os.path.exists(address[len("ipc://"):]), address


def test_back_publish_garbage_does_not_open_the_gate(
    coordinator: CoordinatorFactory, zmq_ctx: Ctx
) -> None:
    """Only a real subscribe-to-everything (one frame, b"\\x01") counts toward the gate."""
    handle = coordinator(2)
    addrs = handle.addresses
    send_garbage(zmq_ctx, addrs, "back_publish", random.Random(11))
    first = RawEngine(zmq_ctx, addrs, 0, handshake=False)
    first.connect_plane()
    first.subscribe()
    assert first.recv_publish(0.4) is None, "the gate opened before the second engine subscribed"
    second = RawEngine(zmq_ctx, addrs, 1, handshake=False)
    second.connect_plane()
    second.subscribe()
    assert first.expect_publish() == [READY]
    assert second.expect_publish() == [READY]
    assert handle.is_alive()

