"""WaveState inside a model of a whole lockstep group: engines, frontends and delayed messages.

The model follows the engine behaviour of vLLM 0.33's lockstep engines:

* an ADD stamped with a newer wave makes the engine adopt it; an idle engine that
  gets an ADD marks itself running first, then reports ``start_wave`` with its wave;
* ``START_DP_WAVE [w, exclude]`` is taken by every engine but ``exclude`` whose own
  wave is not newer than ``w``: it adopts ``w`` and runs;
* the group steps only when every engine is running (the collectives need all of
  them); when nobody has work left after a step, rank 0 reports ``wave_complete``
  and every engine moves to its next wave, idle; otherwise rank 0, if it was idle
  before that step, reports ``start_wave`` (the "mirror" report).

Messages travel on FIFO channels (one per socket and peer) whose deliveries the
rules interleave freely: START_DP_WAVE broadcasts and ADDs reach each engine over
separate sockets, and each engine's reports reach the coordinator over its own.
Frontends stamp requests with whatever wave they last saw published, so stamps can
be stale. A request goes either through the coordinator (which may wake the group)
or, like a stock vLLM frontend, straight to an engine.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from coordinator.core.waves import (
    BroadcastStartWave,
    PublishWave,
    WaveAction,
    WaveState,
    classify_first_request,
    classify_start_wave,
    classify_wave_complete,
)

MAX_ENGINES = 4
MAX_FRONTENDS = 3


@dataclass
class Report:
    """What an engine's output message carries for the coordinator's wave machine."""

    wave_complete: int | None = None
    start_wave: int | None = None


@dataclass
class Engine:
    rank: int
    wave: int = 0
    running: bool = False
    work: int = 0
    idle_before_step: bool = False  # rank 0 reports the edge after its next step
    wakes: deque[tuple[int, int | None]] = field(default_factory=deque)  # back publish
    adds: deque[int] = field(default_factory=deque)  # dispatch, stamped waves
    reports: deque[Report] = field(default_factory=deque)  # to the coordinator

    def wake_up(self) -> None:
        if not self.running:
            self.running = True
            self.idle_before_step = True

    def take_add(self, stamped_wave: int) -> None:
        self.work += 1
        if stamped_wave > self.wave:
            self.wave = stamped_wave
        if not self.running:
            self.wake_up()
            self.reports.append(Report(start_wave=self.wave))

    def take_start_dp_wave(self, wave: int, exclude: int | None) -> None:
        if exclude != self.rank and wave >= self.wave:
            self.wave = wave
            self.wake_up()


class WaveGroup(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.coordinator = WaveState()
        self.engines: list[Engine] = []
        self.frontend_waves: list[int] = []
        self.published: list[int] = [0]
        self.broadcasts: Counter[tuple[int, str]] = Counter()
        self.started_waves_seen: set[int] = set()
        self.last_wave = 0

    # --- setup -----------------------------------------------------------------------------------

    @initialize(
        engines=st.integers(1, MAX_ENGINES),
        frontends=st.integers(1, MAX_FRONTENDS),
    )
    def build(self, engines: int, frontends: int) -> None:
        self.engines = [Engine(rank) for rank in range(engines)]
        self.frontend_waves = [0] * frontends

    # --- helpers ---------------------------------------------------------------------------------

    def perform(self, actions: list[WaveAction], trigger: str) -> None:
        for action in actions:
            if isinstance(action, BroadcastStartWave):
                self.broadcasts[action.wave, trigger] += 1
                assert self.broadcasts[action.wave, trigger] == 1, (
                    f"second {trigger} wake for wave {action.wave}"
                )
                assert action.wave == self.coordinator.current_wave
                for engine in self.engines:
                    engine.wakes.append((action.wave, action.exclude))
            else:
                assert isinstance(action, PublishWave)
                assert action == PublishWave(*self.coordinator.snapshot())
                self.published.append(action.wave)

    def drained(self) -> bool:
        return not any(e.wakes or e.adds or e.reports for e in self.engines)

    # --- frontends -------------------------------------------------------------------------------

    @rule(data=st.data(), through_coordinator=st.booleans())
    def submit(self, data: st.DataObject, through_coordinator: bool) -> None:
        frontend = data.draw(st.integers(0, len(self.frontend_waves) - 1), label="frontend")
        chosen = data.draw(st.integers(0, len(self.engines) - 1), label="engine")
        stamped = self.frontend_waves[frontend]
        if through_coordinator:
            c = self.coordinator
            condition = classify_first_request(
                c.current_wave, c.running, c.wake_pending_for, stamped
            )
            event(f"first_request: {condition.value}")
            self.perform(c.on_first_request(chosen, stamped), "request")
        self.engines[chosen].adds.append(stamped)

    @rule(data=st.data())
    def frontend_hears_publish(self, data: st.DataObject) -> None:
        frontend = data.draw(st.integers(0, len(self.frontend_waves) - 1), label="frontend")
        known = self.frontend_waves[frontend]
        newer = sorted({w for w in self.published if w >= known})
        self.frontend_waves[frontend] = data.draw(st.sampled_from(newer), label="heard")

    # --- message delivery ------------------------------------------------------------------------

    @precondition(lambda self: any(e.wakes for e in self.engines))
    @rule(data=st.data())
    def deliver_start_dp_wave(self, data: st.DataObject) -> None:
        engine = data.draw(st.sampled_from([e for e in self.engines if e.wakes]), label="to")
        engine.take_start_dp_wave(*engine.wakes.popleft())

    @precondition(lambda self: any(e.adds for e in self.engines))
    @rule(data=st.data())
    def deliver_add(self, data: st.DataObject) -> None:
        engine = data.draw(st.sampled_from([e for e in self.engines if e.adds]), label="to")
        engine.take_add(engine.adds.popleft())

    @precondition(lambda self: any(e.reports for e in self.engines))
    @rule(data=st.data())
    def deliver_report(self, data: st.DataObject) -> None:
        engine = data.draw(st.sampled_from([e for e in self.engines if e.reports]), label="from")
        report = engine.reports.popleft()
        c = self.coordinator
        before = c.snapshot()
        if report.wave_complete is not None:
            condition = classify_wave_complete(c.current_wave, report.wave_complete)
            event(f"wave_complete: {condition.value}")
        elif report.start_wave is not None:
            condition = classify_start_wave(
                c.current_wave, c.running, c.wake_pending_for, report.start_wave
            )
            event(f"start_wave: {condition.value}")
        actions = c.on_engine_output(engine.rank, report.wave_complete, report.start_wave)
        self.perform(actions, "engine")
        wave, running = c.snapshot()
        if report.wave_complete is not None:
            if report.wave_complete >= before[0]:
                assert (wave, running) == (report.wave_complete + 1, False)
            else:
                assert (wave, running) == before and actions == []
        elif report.start_wave is not None:
            self.started_waves_seen.add(report.start_wave)
            if report.start_wave >= before[0]:
                assert (wave, running) == (report.start_wave, True)
            else:
                assert (wave, running) == before and actions == []

    # --- the group steps together ----------------------------------------------------------------

    @precondition(lambda self: self.engines and all(e.running for e in self.engines))
    @rule(data=st.data(), finish_everything=st.booleans())
    def group_step(self, data: st.DataObject, finish_everything: bool) -> None:
        for engine in self.engines:
            if finish_everything:
                engine.work = 0
            else:
                engine.work -= data.draw(st.integers(0, engine.work), label=f"done@{engine.rank}")
        rank0 = self.engines[0]
        if not any(e.work for e in self.engines):
            rank0.reports.append(Report(wave_complete=rank0.wave))
            for engine in self.engines:
                engine.running = False
                engine.wave += 1
        elif rank0.idle_before_step:
            rank0.reports.append(Report(start_wave=rank0.wave))
        for engine in self.engines:
            engine.idle_before_step = False

    # --- invariants ------------------------------------------------------------------------------

    @invariant()
    def wave_never_decreases(self) -> None:
        assert self.coordinator.current_wave >= self.last_wave
        self.last_wave = self.coordinator.current_wave

    @invariant()
    def coordinator_is_never_ahead_of_every_engine(self) -> None:
        if self.engines:
            assert self.coordinator.current_wave <= max(e.wave for e in self.engines)

    @invariant()
    def a_reported_start_of_the_current_wave_means_running(self) -> None:
        if self.coordinator.current_wave in self.started_waves_seen:
            assert self.coordinator.running

    @invariant()
    def pending_wake_is_for_the_current_paused_wave(self) -> None:
        pending = self.coordinator.wake_pending_for
        if pending is not None:
            assert pending == self.coordinator.current_wave
            assert not self.coordinator.running

    @invariant()
    def no_engine_waits_for_a_wake_that_was_never_sent(self) -> None:
        # With nothing left in flight, a group with work must be able to step, and no
        # engine may be left stepping (blocked in a collective) beside an idle peer.
        if self.drained():
            engines = [(e.rank, e.wave, e.running, e.work) for e in self.engines]
            if any(e.work for e in self.engines):
                assert all(e.running for e in self.engines), engines
            assert len({e.running for e in self.engines}) <= 1, engines

    def teardown(self) -> None:
        # Let every message through and step until the work is done: the group must
        # always reach quiescence, and the coordinator must end paused and agree.
        for _ in range(100):
            progressed = False
            for engine in self.engines:
                while engine.wakes:
                    engine.take_start_dp_wave(*engine.wakes.popleft())
                    progressed = True
                while engine.adds:
                    engine.take_add(engine.adds.popleft())
                    progressed = True
                while engine.reports:
                    report = engine.reports.popleft()
                    self.perform(
                        self.coordinator.on_engine_output(
                            engine.rank, report.wave_complete, report.start_wave
                        ),
                        "engine",
                    )
                    progressed = True
            if self.engines and all(e.running for e in self.engines):
                for engine in self.engines:
                    engine.work = 0
                rank0 = self.engines[0]
                rank0.reports.append(Report(wave_complete=rank0.wave))
                for engine in self.engines:
                    engine.running = False
                    engine.wave += 1
                    engine.idle_before_step = False
                progressed = True
            if not progressed:
                break
        assert not any(e.work or e.running for e in self.engines)
        if self.engines:
            assert self.coordinator.running is False
            assert self.coordinator.current_wave == self.engines[0].wave


WaveGroup.TestCase.settings = settings(max_examples=150, stateful_step_count=80, deadline=None)
TestWaveGroup = WaveGroup.TestCase
