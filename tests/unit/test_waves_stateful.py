"""WaveState inside a model of a whole lockstep group: engines, frontends, lost messages, time.

The model follows the engine behaviour of vLLM 0.33's lockstep engines:

* an ADD stamped with a newer wave makes the engine adopt it; an idle engine that
  gets an ADD marks itself running first, then reports ``start_wave`` with its wave;
  an engine may also REJECT an ADD (validation failure, shutdown, paused scheduler):
  then nothing happens at all;
* ``START_DP_WAVE [w, exclude]`` is taken by every engine but ``exclude`` whose own
  wave is not newer than ``w``: it adopts ``w`` and runs. An engine may DROP one
  instead (its scheduler is paused, or the publish socket lost it);
* the group steps only when every engine is running (the collectives need all of
  them): a running engine beside an idle peer is blocked, i.e. the group hangs.
  When nobody has work left after a step, rank 0 reports ``wave_complete`` and every
  engine moves to its next wave, idle; otherwise rank 0, if it was idle before that
  step, reports ``start_wave`` (the "mirror" report);
* any engine may send stats carrying its current wave at any time (vLLM sends them
  around steps; allowing more only widens the interleavings).

Messages travel on FIFO channels (one per socket and peer) whose deliveries the
rules interleave freely. Frontends stamp requests with whatever wave they last saw
published, so stamps can be stale. A request goes either through the coordinator
(which may wake the group) or, like a stock vLLM frontend, straight to an engine.
Time advances in steps; the coordinator sees it as ``now``.

Liveness is checked from every state: deliver everything still in flight (nothing
more is lost), and while the group is split let time pass ``rewake_after_s`` and
re-evaluate the coordinator (a frontend retries, or a watchdog asks again). The
group must end either able to step or idle. One kind of loss these rules cannot
repair, and the check allows exactly that kind: the coordinator heard an engine
start the wave (so it believes the group is running and sends nothing more for
it), and an engine that is still idle lost the last START_DP_WAVE sent for that
wave, which was either the relay of that start or a coordinator wake younger than
``rewake_after_s`` when the start was heard.

A second, smaller machine checks how stats rebuild the wave after a coordinator
restart.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import deque
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

from coordinator.core.waves.table import (
    BroadcastStartWave,
    PublishWave,
    WaveAction,
    WaveState,
    classify_first_request,
    classify_reported_wave,
    classify_start_wave,
    classify_wave_complete,
)

MAX_ENGINES = 4
MAX_FRONTENDS = 3
REWAKE = 1.0
RECOVERY_ROUNDS = 3

REQUEST = "request"  # a wake the coordinator sent for a request it dispatched
RELAY = "relay"  # the coordinator relaying an engine's start_wave
CHANNELS = ("wakes", "adds", "reports")


@dataclass
class Report:
    """What an engine's output message carries for the coordinator's wave machine."""

    wave_complete: int | None = None
    start_wave: int | None = None
    stats_wave: int | None = None


@dataclass(frozen=True)
class Wake:
    """One START_DP_WAVE as sent, with what the model needs to judge a loss."""

    serial: int
    wave: int
    exclude: int | None
    trigger: str
    sent_at: float


@dataclass
class Engine:
    rank: int
    wave: int = 0
    running: bool = False
    work: int = 0
    idle_before_step: bool = False  # rank 0 reports the edge after its next step
    wakes: deque[Wake] = field(default_factory=deque)  # back publish
    adds: deque[int] = field(default_factory=deque)  # dispatch, stamped waves
    reports: deque[Report] = field(default_factory=deque)  # to the coordinator
    dropped: set[int] = field(default_factory=set)  # serials of wakes it lost

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

    def take_start_dp_wave(self, wake: Wake) -> None:
        if wake.exclude != self.rank and wake.wave >= self.wave:
            self.wave = wake.wave
            self.wake_up()


@dataclass
class World:
    """Everything in the model; copied whole to look ahead for liveness."""

    coordinator: WaveState
    engines: list[Engine]
    frontend_waves: list[int]
    now: float = 0.0
    published: list[int] = field(default_factory=lambda: [0])
    sent: int = 0  # wakes sent so far, for serial numbers
    wakes_sent: dict[tuple[int, str], list[float]] = field(default_factory=dict)
    last_wake: dict[int, Wake] = field(default_factory=dict)  # per wave
    heard_start_at: dict[int, float] = field(default_factory=dict)  # per wave
    started_waves_seen: set[int] = field(default_factory=set)

    def clone(self) -> World:
        twin = copy.copy(self)
        twin.coordinator = copy.copy(self.coordinator)
        twin.engines = [
            dataclasses.replace(
                e,
                wakes=deque(e.wakes),
                adds=deque(e.adds),
                reports=deque(e.reports),
                dropped=set(e.dropped),
            )
            for e in self.engines
        ]
        twin.frontend_waves = list(self.frontend_waves)
        twin.published = list(self.published)
        twin.wakes_sent = {k: list(v) for k, v in self.wakes_sent.items()}
        twin.last_wake = dict(self.last_wake)
        twin.heard_start_at = dict(self.heard_start_at)
        twin.started_waves_seen = set(self.started_waves_seen)
        return twin

    def perform(self, actions: list[WaveAction], trigger: str) -> None:
        for action in actions:
            if isinstance(action, BroadcastStartWave):
                assert action.wave == self.coordinator.current_wave
                times = self.wakes_sent.setdefault((action.wave, trigger), [])
                # One wake per wave and trigger, except a coordinator wake that
                # expired; a relay happens at most once per wave, ever.
                if times:
                    assert trigger == REQUEST, f"second relay for wave {action.wave}"
                    assert self.now - times[-1] >= REWAKE, (
                        f"wave {action.wave} woken again after {self.now - times[-1]} s"
                    )
                times.append(self.now)
                self.sent += 1
                wake = Wake(self.sent, action.wave, action.exclude, trigger, self.now)
                self.last_wake[action.wave] = wake
                for engine in self.engines:
                    engine.wakes.append(wake)
            else:
                assert isinstance(action, PublishWave)
                assert action == PublishWave(*self.coordinator.snapshot())
                self.published.append(action.wave)

    def first_request(self, chosen: int, stamped: int) -> None:
        self.perform(self.coordinator.on_first_request(chosen, stamped, now=self.now), REQUEST)

    def deliver_report(self, engine: Engine) -> None:
        report = engine.reports.popleft()
        c = self.coordinator
        before = c.snapshot()
        if report.stats_wave is not None:
            actions = c.on_reported_wave(engine.rank, report.stats_wave)
        else:
            actions = c.on_engine_output(
                engine.rank, report.wave_complete, report.start_wave, now=self.now
            )
        self.perform(actions, RELAY)
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
                if before != (wave, True):
                    self.heard_start_at[wave] = self.now
            else:
                assert (wave, running) == before and actions == []
        elif report.stats_wave is not None:
            if report.stats_wave > before[0]:
                assert (wave, running) == (report.stats_wave, False)
                assert actions == [PublishWave(wave, False)]
            else:
                assert (wave, running) == before and actions == []

    def group_step(self, done: list[int]) -> None:
        for engine, finished in zip(self.engines, done, strict=True):
            engine.work -= finished
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

    def deliver_everything(self) -> None:
        while any(e.wakes or e.adds or e.reports for e in self.engines):
            for engine in self.engines:
                while engine.wakes:
                    engine.take_start_dp_wave(engine.wakes.popleft())
                while engine.adds:
                    engine.take_add(engine.adds.popleft())
                while engine.reports:
                    self.deliver_report(engine)

    def split(self) -> bool:
        """Some engine runs (blocked in a collective) while a peer is idle."""
        return len({e.running for e in self.engines}) > 1

    def recover(self) -> None:
        """Deliver what is in flight; while split, wait out the wake and ask again."""
        for _ in range(RECOVERY_ROUNDS):
            self.deliver_everything()
            if not self.split():
                return
            self.now += REWAKE
            # A retried request goes to the least-loaded engine: an idle one.
            idle = min(e.rank for e in self.engines if not e.running)
            self.first_request(idle, self.coordinator.current_wave)
        self.deliver_everything()

    def unrepairable_loss(self) -> bool:
        """The one loss the rules do not repair (see the module docstring)."""
        c = self.coordinator
        wake = self.last_wake.get(c.current_wave)
        if not c.running or wake is None:
            return False
        lost_by_an_idle_engine = any(
            wake.serial in e.dropped for e in self.engines if not e.running
        )
        heard = self.heard_start_at.get(c.current_wave)
        answered_too_soon = heard is not None and heard - wake.sent_at < REWAKE
        return lost_by_an_idle_engine and (wake.trigger == RELAY or answered_too_soon)


class WaveGroup(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.world = World(WaveState(rewake_after_s=REWAKE), [], [])
        self.last_wave = 0
        self.lost_anything = False

    @initialize(engines=st.integers(1, MAX_ENGINES), frontends=st.integers(1, MAX_FRONTENDS))
    def build(self, engines: int, frontends: int) -> None:
        self.world.engines = [Engine(rank) for rank in range(engines)]
        self.world.frontend_waves = [0] * frontends

    # --- frontends -------------------------------------------------------------------------------

    @rule(data=st.data(), through_coordinator=st.booleans(), heard_first=st.booleans())
    def submit(self, data: st.DataObject, through_coordinator: bool, heard_first: bool) -> None:
        w = self.world
        frontend = data.draw(st.integers(0, len(w.frontend_waves) - 1), label="frontend")
        if heard_first:
            # The frontend catches up on publishes (it may skip some) before submitting.
            known = w.frontend_waves[frontend]
            newer = sorted({p for p in w.published if p >= known})
            w.frontend_waves[frontend] = data.draw(st.sampled_from(newer), label="heard")
        chosen = data.draw(st.integers(0, len(w.engines) - 1), label="engine")
        stamped = w.frontend_waves[frontend]
        if through_coordinator:
            c = w.coordinator
            condition = classify_first_request(
                c.current_wave, c.running, c.wake_pending(w.now), stamped
            )
            event(f"first_request: {condition.value}")
            w.first_request(chosen, stamped)
        w.engines[chosen].adds.append(stamped)

    # Binary fractions keep the sums of time steps exact.
    @rule(data=st.data(), dt=st.sampled_from([2.0**-10, 0.25, REWAKE]), ask_again=st.booleans())
    def time_passes(self, data: st.DataObject, dt: float, ask_again: bool) -> None:
        w = self.world
        w.now += dt
        if ask_again:
            # A watchdog (or a frontend retrying) has the coordinator re-evaluate.
            chosen = data.draw(st.integers(0, len(w.engines) - 1), label="engine")
            w.first_request(chosen, w.coordinator.current_wave)

    # --- message delivery and loss ---------------------------------------------------------------

    def in_flight(self) -> bool:
        return any(e.wakes or e.adds or e.reports for e in self.world.engines)

    @precondition(in_flight)
    @rule(data=st.data(), mishap=st.sampled_from([False, False, False, True]))
    def deliver_one(self, data: st.DataObject, mishap: bool) -> None:
        """Deliver the next message on one channel; a wake may be lost, an ADD rejected."""
        w = self.world
        channels = [(e, name) for e in w.engines for name in CHANNELS if getattr(e, name)]
        engine, name = data.draw(st.sampled_from(channels), label="channel")
        if name == "wakes":
            wake = engine.wakes.popleft()
            if mishap:
                engine.dropped.add(wake.serial)
                self.lost_anything = True
                event(f"lost a {wake.trigger} wake")
            else:
                engine.take_start_dp_wave(wake)
        elif name == "adds":
            stamped = engine.adds.popleft()
            if mishap:
                event("rejected an ADD")
            else:
                engine.take_add(stamped)
        else:
            self.note_report(engine.reports[0])
            w.deliver_report(engine)

    @precondition(lambda self: self.in_flight() or self.all_running())
    @rule(data=st.data(), finish_everything=st.booleans())
    def quiet_moment(self, data: st.DataObject, finish_everything: bool) -> None:
        """Every channel drains in order, nothing is lost, and the group steps if it can."""
        self.world.deliver_everything()
        if self.all_running():
            self.group_step(data, finish_everything)

    def note_report(self, report: Report) -> None:
        c, now = self.world.coordinator, self.world.now
        if report.wave_complete is not None:
            condition = classify_wave_complete(c.current_wave, report.wave_complete)
            event(f"wave_complete: {condition.value}")
        elif report.start_wave is not None:
            condition = classify_start_wave(
                c.current_wave, c.running, c.wake_pending(now), report.start_wave
            )
            event(f"start_wave: {condition.value}")
        elif report.stats_wave is not None:
            condition = classify_reported_wave(c.current_wave, report.stats_wave)
            event(f"reported_wave: {condition.value}")

    @rule(data=st.data())
    def engine_sends_stats(self, data: st.DataObject) -> None:
        engine = data.draw(st.sampled_from(self.world.engines), label="from")
        engine.reports.append(Report(stats_wave=engine.wave))

    # --- the group steps together ----------------------------------------------------------------

    def all_running(self) -> bool:
        return bool(self.world.engines) and all(e.running for e in self.world.engines)

    @precondition(all_running)
    @rule(data=st.data(), finish_everything=st.booleans())
    def group_step(self, data: st.DataObject, finish_everything: bool) -> None:
        done = [
            e.work if finish_everything else data.draw(st.integers(0, e.work), label="done")
            for e in self.world.engines
        ]
        self.world.group_step(done)

    # --- invariants ------------------------------------------------------------------------------

    @invariant()
    def wave_never_decreases(self) -> None:
        assert self.world.coordinator.current_wave >= self.last_wave
        self.last_wave = self.world.coordinator.current_wave

    @invariant()
    def coordinator_is_never_ahead_of_every_engine(self) -> None:
        if self.world.engines:
            assert self.world.coordinator.current_wave <= max(e.wave for e in self.world.engines)

    @invariant()
    def a_heard_start_of_the_current_wave_means_running(self) -> None:
        c = self.world.coordinator
        if c.current_wave in self.world.started_waves_seen:
            assert c.running

    @invariant()
    def pending_wake_is_for_the_current_paused_wave(self) -> None:
        c = self.world.coordinator
        if c.wake_pending_for is not None:
            assert c.wake_pending_for == c.current_wave
            assert not c.running

    @invariant()
    def an_engine_with_work_runs(self) -> None:
        assert all(e.running for e in self.world.engines if e.work)

    @invariant()
    def the_group_never_stays_hung(self) -> None:
        if not self.world.engines:
            return
        ahead = self.world.clone()
        ahead.recover()
        if ahead.split():
            state = [(e.rank, e.wave, e.running, e.work) for e in ahead.engines]
            assert self.lost_anything, f"hung without any loss: {state}"
            assert ahead.unrepairable_loss(), f"hung: {state}, {ahead.coordinator.snapshot()}"
            event("hung after a loss the rules cannot see")

    def teardown(self) -> None:
        # Recover, then let the group step until the work is done: unless a loss the
        # rules cannot see split it, it reaches quiescence and the coordinator agrees.
        w = self.world
        if not w.engines:
            return
        for _ in range(100):
            w.recover()
            if w.split() or not any(e.running for e in w.engines):
                break
            w.group_step([e.work for e in w.engines])
        if w.split():
            assert w.unrepairable_loss()
            return
        w.deliver_everything()
        assert not any(e.work or e.running for e in w.engines)
        assert w.coordinator.running is False
        assert w.coordinator.current_wave == w.engines[0].wave


WaveGroup.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestWaveGroup = WaveGroup.TestCase


# --- stats rebuild the wave, across coordinator restarts ------------------------------------------


@dataclass
class Sent:
    """One engine output message, tagged with the coordinator incarnation it was sent to."""

    kind: str  # "stats", "start_wave" or "wave_complete"
    wave: int
    incarnation: int


@dataclass
class Member:
    rank: int
    wave: int = 0
    outbox: deque[Sent] = field(default_factory=deque)


class WaveRebuild(RuleBasedStateMachine):
    """Engines move through waves together; stats reports carry their wave.

    After a wave ends every engine moves to the next one, each at its own moment
    (rank 0 reports ``wave_complete`` as it does), so reports of different waves
    interleave. The coordinator may restart at any time, back at wave 0, with what
    was in flight either kept or lost. Frontends stamp requests with any wave a
    coordinator ever published.
    """

    def __init__(self) -> None:
        super().__init__()
        self.coordinator = WaveState(rewake_after_s=REWAKE)
        self.members: list[Member] = []
        self.group_wave = 0
        self.group_running = False
        self.published: set[int] = {0}
        self.now = 0.0
        self.incarnation = 0
        self.floor = 0  # lowest wave this incarnation may show
        self.wave_at_restart = 0
        self.reported: set[int] = set()  # ranks whose stats reached this incarnation
        self.heard_start: set[int] = set()  # waves this incarnation heard start

    @initialize(engines=st.integers(1, MAX_ENGINES))
    def build(self, engines: int) -> None:
        self.members = [Member(rank) for rank in range(engines)]

    def caught_up(self) -> bool:
        return all(m.wave == self.group_wave for m in self.members)

    def perform(self, actions: list[WaveAction]) -> None:
        for action in actions:
            if isinstance(action, PublishWave):
                assert action == PublishWave(*self.coordinator.snapshot())
                self.published.add(action.wave)

    @precondition(
        lambda self: not self.group_running and any(m.wave == self.group_wave for m in self.members)
    )
    @rule(data=st.data())
    def an_engine_starts_the_wave(self, data: st.DataObject) -> None:
        # An engine that already moved on may start the next wave while a peer
        # (rank 0 with its wave_complete, say) has not yet.
        ready = [m for m in self.members if m.wave == self.group_wave]
        member = data.draw(st.sampled_from(ready), label="starter")
        member.outbox.append(Sent("start_wave", member.wave, self.incarnation))
        self.group_running = True

    @precondition(lambda self: self.group_running and self.caught_up())
    @rule()
    def the_wave_ends(self) -> None:
        self.group_running = False
        self.group_wave += 1

    @precondition(lambda self: not self.caught_up())
    @rule(data=st.data())
    def an_engine_moves_on(self, data: st.DataObject) -> None:
        behind = [m for m in self.members if m.wave < self.group_wave]
        member = data.draw(st.sampled_from(behind), label="engine")
        if member.rank == 0:
            member.outbox.append(Sent("wave_complete", member.wave, self.incarnation))
        member.wave = self.group_wave

    @rule(data=st.data())
    def an_engine_sends_stats(self, data: st.DataObject) -> None:
        member = data.draw(st.sampled_from(self.members), label="engine")
        member.outbox.append(Sent("stats", member.wave, self.incarnation))

    @precondition(lambda self: any(m.outbox for m in self.members))
    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        member = data.draw(st.sampled_from([m for m in self.members if m.outbox]), label="from")
        self.receive(member)

    def receive(self, member: Member) -> None:
        sent, c = member.outbox.popleft(), self.coordinator
        if sent.kind == "stats":
            event(f"reported_wave: {classify_reported_wave(c.current_wave, sent.wave).value}")
            self.perform(c.on_reported_wave(member.rank, sent.wave))
            if sent.incarnation == self.incarnation:
                self.reported.add(member.rank)
        elif sent.kind == "start_wave":
            self.perform(c.on_start_wave(member.rank, sent.wave, now=self.now))
            self.heard_start.add(sent.wave)
        else:
            self.perform(c.on_wave_complete(member.rank, sent.wave))

    @rule(data=st.data())
    def a_request_comes_through_the_coordinator(self, data: st.DataObject) -> None:
        stamped = data.draw(st.sampled_from(sorted(self.published)), label="stamped")
        chosen = data.draw(st.sampled_from(self.members), label="engine").rank
        c = self.coordinator
        event(
            "first_request: "
            + classify_first_request(
                c.current_wave, c.running, c.wake_pending(self.now), stamped
            ).value
        )
        self.now += 0.25
        actions = c.on_first_request(chosen, stamped, now=self.now)
        for action in actions:
            if isinstance(action, BroadcastStartWave):
                # The chosen engine adopts the stamp, and ignores any older wake.
                assert action.wave >= stamped
        self.perform(actions)

    @rule(lose_in_flight=st.booleans())
    def the_coordinator_restarts(self, lose_in_flight: bool) -> None:
        self.coordinator = WaveState(rewake_after_s=REWAKE)
        self.incarnation += 1
        self.floor = 0
        self.wave_at_restart = max(m.wave for m in self.members)
        self.reported = set()
        self.heard_start = set()
        if lose_in_flight:
            for member in self.members:
                member.outbox.clear()

    @rule()
    def everyone_reports(self) -> None:
        # Deliver what is in flight, then one fresh report from each engine.
        for member in self.members:
            while member.outbox:
                self.receive(member)
        for member in self.members:
            member.outbox.append(Sent("stats", member.wave, self.incarnation))
            self.receive(member)
        assert self.coordinator.current_wave == max(m.wave for m in self.members)

    @invariant()
    def never_beyond_what_an_engine_reached(self) -> None:
        if self.members:
            assert self.coordinator.current_wave <= max(m.wave for m in self.members)

    @invariant()
    def never_back(self) -> None:
        assert self.coordinator.current_wave >= self.floor
        self.floor = self.coordinator.current_wave

    @invariant()
    def caught_up_once_every_engine_reported(self) -> None:
        if self.members and len(self.reported) == len(self.members):
            assert self.coordinator.current_wave >= self.wave_at_restart

    @invariant()
    def stats_never_hide_a_start_that_was_heard(self) -> None:
        c = self.coordinator
        running_and_heard = self.group_running and self.group_wave in self.heard_start
        if running_and_heard and c.current_wave == self.group_wave:
            assert c.running


WaveRebuild.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
TestWaveRebuild = WaveRebuild.TestCase
