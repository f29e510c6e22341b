"""A batch of back_output frames: which are decoded, and what the core ends up with.

`plan_batch` is the pure part of the batched stats reader. Against the
one-by-one reading it replaces, on generated batches (stats of a few
engines, wave messages with and without stats, engine indices out of range,
bad frames and several-frame messages, in any order):

* every event it keeps is one the one-by-one reading has, in the same order;
  what it leaves out are only stats reports that carry nothing else, name no
  wave past the floor, and are followed by a later stats-only report of the
  same managed engine;
* every wave message, every bad frame and each engine's newest statistics
  are kept;
* fed to a core, both readings end in the same wave, the same rows, the same
  pending step snapshot, and publish the same bytes at every tick between
  batches (the lockstep step snapshot included: a report a snapshot records is
  never skipped), the same broadcasts and the same counters, except that
  `stats.reports` is split into `stats.reports` and `stats.superseded` (and
  `stats.stale`, which compares a report with the one applied before it,
  counts only applied ones) -- as long as the statistics themselves are well
  formed. A superseded report with malformed statistics is counted as
  superseded, not as bad (docs/OPERATIONS.md says so).
"""

from __future__ import annotations

import random
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.core.actions import Publish
from coordinator.core.coordinator import CoordinatorCore, CoreConfig
from coordinator.core.events import ENGINE_SUBSCRIBED, BadFrame, Tick
from coordinator.protocol import vllm
from coordinator.server.planes.back_output import decode_frame, frame_count_error
from coordinator.server.stats_reader import Pending, plan_batch
from tests.vllm_peers import engine_outputs, scheduler_stats

RANKS = range(0, 4)
STATS_ONLY_KEYS = ("stats.reports", "stats.superseded", "stats.stale")


Spec = tuple[str, int, int, int, int, int, int]
"""(kind, rank, wave, waiting, running, step, reported wave) of one generated frame."""

KINDS = ["stats", "stats", "stats", "stats", "complete", "start", "wave_with_stats", "bad",
         "multipart", "malformed_stats", "no_stats"]
specs = st.tuples(st.sampled_from(KINDS), st.sampled_from([0, 1, 2, 3, 3, 7]),
                  st.integers(0, 4), st.integers(0, 9), st.integers(0, 9), st.integers(0, 5),
                  st.integers(0, 2))


def build(batch_specs: list[list[Spec]], *, well_formed: bool) -> list[list[Pending]]:
    """Frames for the specs; each engine's reported wave only goes up, as engines' do."""
    reported: dict[int, int] = {}
    out: list[list[Pending]] = []
    for batch in batch_specs:
        frames: list[Pending] = []
        for kind, rank, wave, waiting, running, step, wave_step in batch:
            reported[rank] = reported.get(rank, 0) + wave_step
            stats = scheduler_stats(waiting=waiting, running=running, step=step,
                                    kv_cache_usage=(waiting % 3) / 4, wave=reported[rank])
            if kind == "stats":
                frames.append(engine_outputs(rank, stats=stats))
            elif kind == "complete":
                frames.append(engine_outputs(rank, wave_complete=wave))
            elif kind == "start":
                frames.append(engine_outputs(rank, start_wave=wave))
            elif kind == "wave_with_stats":
                frames.append(engine_outputs(rank, stats=stats, start_wave=wave))
            elif kind == "bad":
                frames.append([b"\x99", b"\xc1", engine_outputs(rank, start_wave=-1)][wave % 3])
            elif kind == "multipart":
                frames.append(frame_count_error(2))
            elif kind == "malformed_stats" and not well_formed:
                frames.append(engine_outputs(rank, stats={"num_running_reqs": -3}))
            else:
                frames.append(engine_outputs(rank))
        out.append(frames)
    return out


batch_specs = st.lists(st.lists(specs, max_size=40), min_size=1, max_size=4)


def one_by_one(batch: list[Pending]) -> list[vllm.EngineReport | BadFrame]:
    return [frame if isinstance(frame, BadFrame) else decode_frame(frame) for frame in batch]


def carries_only_stats(event: object) -> bool:
    return (isinstance(event, vllm.EngineReport) and event.scheduler_stats is not None
            and event.wave_complete is None and event.start_wave is None)


STEP_STATES = [None, (None, False), ((0, 0), True), ((1, 3), True), ((2, 0), False)]
"""Dense (no snapshot rule), and lockstep cores with various marks and changed flags."""


@settings(max_examples=400, deadline=None)
@given(batch_specs, st.integers(0, 3), st.sampled_from(STEP_STATES))
def test_only_superseded_stats_reports_are_left_out(
        specs_list: list[list[Spec]], floor: int,
        steps: tuple[tuple[int, int] | None, bool] | None) -> None:
    for batch in build(specs_list, well_formed=False):
        check_batch(batch, floor, steps)


def check_batch(batch: list[Pending], floor: int,
                steps: tuple[tuple[int, int] | None, bool] | None = None) -> None:
    reference = one_by_one(batch)
    events, superseded = plan_batch(batch, RANKS, floor, steps)
    assert len(events) == len(batch)
    left_out = [index for index, event in enumerate(events) if event is None]
    assert len(left_out) == superseded
    for index, event in enumerate(events):
        if event is None:
            continue
        want = reference[index]
        if isinstance(want, BadFrame):
            assert isinstance(event, BadFrame)
            assert (event.error.reason, str(event.error), event.frame_count) == (
                want.error.reason, str(want.error), want.frame_count)
        else:
            assert event == want
    for index in left_out:
        frame = batch[index]
        assert isinstance(frame, bytes)
        event = reference[index]
        # A sound envelope with statistics (well formed or not) and nothing else.
        assert carries_only_stats(event) or (
            isinstance(event, BadFrame) and event.error.reason == "bad_value")
        if isinstance(event, vllm.EngineReport):
            assert event.scheduler_stats is not None
            assert event.scheduler_stats.current_wave <= floor
        rank = msgspec_rank(frame)
        assert rank in RANKS
        later = [e for e in events[index + 1:] if e is not None]
        assert any(carries_only_stats(e) and e.engine_index == rank  # type: ignore[union-attr]
                   for e in later), (index, rank)
    # Everything else is kept: wave messages, bad frames, each engine's newest stats.
    for index, event in enumerate(reference):
        if isinstance(event, BadFrame) or not carries_only_stats(event):
            assert index not in left_out or (
                isinstance(event, BadFrame) and event.error.reason == "bad_value")
            continue
        newer = [j for j in range(index + 1, len(reference))
                 if carries_only_stats(reference[j])
                 and reference[j].engine_index == event.engine_index]  # type: ignore[union-attr]
        assert event.scheduler_stats is not None
        if not newer or event.engine_index not in RANKS or (
                event.scheduler_stats.current_wave > floor):
            assert index not in left_out


def msgspec_rank(frame: bytes) -> int:
    import msgspec

    value: Any = msgspec.msgpack.decode(frame)
    return int(value[0])


class Fed:
    """A core fed events as the server feeds it (gate open), keeping what it published.

    Each batch is fed at its own moment; two ticks follow it, far enough apart that
    a publish is due at each: the step snapshot goes out at the first, the current
    rows at the second. No publish can fall inside a batch (the reader feeds a
    batch before the timer runs), so that is where the one-by-one reading's ticks are.
    """

    def __init__(self, lockstep: bool = True) -> None:
        # The hang watchdog is off: its alerts judge the time between single reports,
        # which the ticks here (far apart, to make every publish due) would trip, and a
        # skipped report is not one it sees (left for later: see the report of issue 19).
        self.core = CoordinatorCore(
            CoreConfig(rank_start=0, engines=len(RANKS), lockstep=lockstep,
                       watchdog_stall_s=0),
            rng=random.Random(0), now=0.0)
        self.published: list[Any] = []
        self.now = 0.0
        for _ in RANKS:
            self.core.handle(ENGINE_SUBSCRIBED, self.now)

    def feed(self, events: list[vllm.EngineReport | BadFrame | None], superseded: int = 0
             ) -> None:
        self.now += 1.0
        for event in events:
            if event is None:
                continue
            if isinstance(event, vllm.EngineReport):
                actions = self.core.on_engine_report(event, self.now)
            else:
                actions = self.core.handle(event, self.now)
            self.published.extend(a for a in actions if isinstance(a, Publish))
        if superseded:
            self.core.note_stats_superseded(superseded)

    def tick(self) -> None:
        for _ in range(2):
            self.now += 10.0
            self.published.extend(a for a in self.core.handle(Tick(), self.now)
                                  if isinstance(a, Publish))

    def row_publishes(self) -> list[Any]:
        return [msgspec.msgpack.decode(a.frames[0])[0] for a in self.published
                if a.socket == "front_publish"
                and msgspec.msgpack.decode(a.frames[0])[0] is not None]


def feed_both(batch_list: list[list[Pending]], *, lockstep: bool = True) -> tuple[Fed, Fed, int]:
    """The same batches one by one and through ``plan_batch``, with ticks between."""
    reference, batched = Fed(lockstep), Fed(lockstep)
    superseded = 0
    for batch in batch_list:
        reference.feed(one_by_one(batch))
        reference.tick()
        core = batched.core
        events, skipped = plan_batch(batch, RANKS, core.skippable_wave(), core.step_state())
        batched.feed(events, skipped)
        batched.tick()
        superseded += skipped
    return reference, batched, superseded


def assert_same(reference: Fed, batched: Fed, superseded: int) -> None:
    assert batched.core.waves.snapshot() == reference.core.waves.snapshot()
    assert batched.core.loads.rows() == reference.core.loads.rows()
    assert batched.core.loads.step_mark == reference.core.loads.step_mark
    assert batched.core.loads.take_publish_rows() == reference.core.loads.take_publish_rows()
    assert batched.published == reference.published
    want = reference.core.counter_values()
    got = batched.core.counter_values()
    assert {k: v for k, v in got.items() if k not in STATS_ONLY_KEYS} == {
        k: v for k, v in want.items() if k not in STATS_ONLY_KEYS}
    assert got.get("stats.reports", 0) + got.get("stats.superseded", 0) == want.get(
        "stats.reports", 0)
    assert got.get("stats.superseded", 0) == superseded


@settings(max_examples=300, deadline=None)
@given(batch_specs, st.booleans())
def test_the_core_ends_in_the_same_state(specs_list: list[list[Spec]], lockstep: bool) -> None:
    batch_list = build(specs_list, well_formed=True)
    assert_same(*feed_both(batch_list, lockstep=lockstep))


def test_a_step_snapshot_is_published_as_one_by_one() -> None:
    """Issue 19: step 1 of engine 0, step 1 of engine 1, step 2 of engine 0 in one
    batch. vLLM 0.33 publishes the step-1 rows first; skipping engine 0's step-1
    report (superseded by its step 2) would lose them."""
    warm = [engine_outputs(r, stats=scheduler_stats(step=0)) for r in RANKS]
    batch = [engine_outputs(0, stats=scheduler_stats(waiting=1, step=1)),
             engine_outputs(1, stats=scheduler_stats(waiting=2, step=1)),
             engine_outputs(0, stats=scheduler_stats(waiting=5, step=2))]
    reference, batched, superseded = feed_both([warm, batch])
    assert reference.row_publishes()[-2:] == [
        [[1, 0, 0.0], [2, 0, 0.0], [0, 0, 0.0], [0, 0, 0.0]],  # the step-1 snapshot
        [[5, 0, 0.0], [2, 0, 0.0], [0, 0, 0.0], [0, 0, 0.0]]]
    assert batched.row_publishes() == reference.row_publishes()
    assert_same(reference, batched, superseded)


def test_a_lockstep_flood_still_skips_what_no_snapshot_records() -> None:
    """Engines stepping together: only each step's first report takes a snapshot, so
    the others' earlier reports may go, except those the last snapshot records."""
    batch = [engine_outputs(rank, stats=scheduler_stats(waiting=step + rank, step=step))
             for step in range(1, 11) for rank in RANKS]
    _, superseded = plan_batch(batch, RANKS, 0, ((0, 0), True))
    assert superseded == 24  # ranks 1-3, steps 1-8
    reference, batched, skipped = feed_both([batch])
    assert skipped == superseded
    assert_same(reference, batched, skipped)


steps_of = st.lists(st.tuples(st.sampled_from(list(RANKS)), st.integers(0, 2),
                              st.integers(0, 9), st.booleans()), max_size=60)


@settings(max_examples=300, deadline=None)
@given(st.lists(steps_of, min_size=1, max_size=4), st.booleans())
def test_random_interleavings_of_steps_and_engines(
        batches: list[list[tuple[int, int, int, bool]]], restart: bool) -> None:
    """Each engine's (wave, step) goes up (or, once, restarts at 0), engines
    interleaved at random; a wave message now and then. Publishes, snapshot and
    rows equal the one-by-one reading's."""
    marks = {rank: (0, 0) for rank in RANKS}
    restarted = False
    batch_list: list[list[Pending]] = []
    for specs_ in batches:
        frames: list[Pending] = []
        for rank, advance, waiting, wave_message in specs_:
            wave, step = marks[rank]
            if restart and not restarted and advance == 0 and waiting == 9:
                restarted, step = True, 0
            elif advance == 2 and waiting == 0:
                wave, step = wave + 1, 0
            else:
                step += advance
            marks[rank] = (wave, step)
            if wave_message and waiting == 7:
                frames.append(engine_outputs(rank, wave_complete=wave))
            frames.append(engine_outputs(rank, stats=scheduler_stats(
                waiting=waiting, running=step % 3, step=step, wave=wave)))
        batch_list.append(frames)
    assert_same(*feed_both(batch_list))


def test_a_flood_of_one_engine_keeps_its_newest_report_and_every_wave_message() -> None:
    batch: list[Pending] = []
    for n in range(50):
        batch.append(engine_outputs(1, stats=scheduler_stats(waiting=n, step=n)))
        if n % 10 == 5:
            batch.append(engine_outputs(0, start_wave=n))
    planned, superseded = plan_batch(batch, RANKS, 0)
    events = [event for event in planned if event is not None]
    assert superseded == 49
    assert [e.start_wave for e in events if isinstance(e, vllm.EngineReport)][:5] == [
        5, 15, 25, 35, 45]
    last = events[-1]
    assert isinstance(last, vllm.EngineReport) and last.scheduler_stats is not None
    assert last.scheduler_stats.num_waiting_reqs == 49


def test_engines_outside_the_managed_ranks_supersede_nothing() -> None:
    batch: list[Pending] = [engine_outputs(9, stats=scheduler_stats(waiting=n)) for n in range(5)]
    events, superseded = plan_batch(batch, RANKS, 0)
    assert superseded == 0 and None not in events


def test_a_report_naming_a_newer_wave_is_kept() -> None:
    """It moves the coordinator's wave, so where it stands in the order matters."""
    batch: list[Pending] = [engine_outputs(1, stats=scheduler_stats(waiting=1, wave=3)),
                            engine_outputs(2, wave_complete=0),
                            engine_outputs(1, stats=scheduler_stats(waiting=2, wave=3))]
    assert plan_batch(batch, RANKS, 2)[1] == 0
    assert plan_batch(batch, RANKS, 3)[1] == 1
