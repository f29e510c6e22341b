"""The wave domain's handlers: the wave table's actions carried out, through the gate.

The rules are the machines beside this module: the wave table
(``waves.table``), the start-up gate (``waves.gate``) and the hang watchdog
(``waves.watchdog``). ``WaveHandlers`` applies what they decide: every
``BroadcastStartWave`` becomes a START_DP_WAVE on ``back_publish`` unless the
gate holds it, every ``PublishWave`` a ``[nil, wave, running]`` on
``front_publish``, each recorded and timed (``WaveTimeline``). It also answers
the events that belong to waves alone: an engine subscribing on
``back_publish`` (the gate), the pre-0.33 frontend wake, the observe timer
(wake retries and the watchdog).

A first request's wake is handed back rather than appended
(``first_request``): it rides on the ``DispatchAdd`` and leaves right after
the ADD, so that the chosen engine holds its request before its peers step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from logging import DEBUG, ERROR, INFO, WARNING

from coordinator.core.actions import REARM_TIMER, Action, Publish
from coordinator.core.config import CoreConfig
from coordinator.core.observe.journal import Journal
from coordinator.core.observe.publishing import PublishSchedule
from coordinator.core.observe.recorder import KIND_WAKE, KIND_WATCHDOG, KIND_WAVE, WaveTimeline
from coordinator.core.outbox import Outbox
from coordinator.core.ranks.span import RankSpan
from coordinator.core.waves.gate import GateStep, StartGate
from coordinator.core.waves.table import BroadcastStartWave, PublishWave, WaveAction, WaveState
from coordinator.core.waves.watchdog import NO_PROGRESS, HangWatchdog
from coordinator.protocol import vllm


class WaveHandlers:
    """The wave table, the gate and the watchdog, and what their decisions send."""

    def __init__(self, config: CoreConfig, journal: Journal, span: RankSpan,
                 schedule: PublishSchedule, all_dead: Callable[[], bool], *,
                 now: float) -> None:
        self._config = config
        self._all_dead = all_dead
        self._journal = journal
        self._span = span
        self._schedule = schedule
        self.table = WaveState(lockstep=config.lockstep, rewake_after_s=config.rewake_after_s)
        self.gate = StartGate(config.engines)
        self.watchdog = HangWatchdog(stall_after_s=config.watchdog_stall_s or 30.0)
        self.timeline = WaveTimeline(now=now)
        # Which forms of the pre-0.33 frontend wake were logged (by identity bytes or not).
        self._frontend_wake_forms: set[bool] = set()

    def snapshot(self) -> tuple[int, bool]:
        return self.table.snapshot()

    # ---- carrying out the table's decisions -------------------------------------------

    def apply(self, actions: Sequence[WaveAction], now: float, out: Outbox, *, cause: str,
              rank: int | None, coordinator_wake: bool = False) -> None:
        counters = self._journal.counters
        for action in actions:
            if isinstance(action, BroadcastStartWave):
                self.wake(vllm.encode_start_dp_wave(action.wave, action.exclude), out)
                counters["waves.start_broadcasts"] += 1
                if coordinator_wake:
                    self.timeline.wake_sent(action.wave, now)
                self._journal.record(now, KIND_WAKE, cause, rank=rank, exclude=action.exclude)
                out.log(DEBUG, "START_DP_WAVE [%d, %s] (%s)", action.wave, action.exclude,
                        cause)
            elif isinstance(action, PublishWave):
                out.add(Publish("front_publish", (
                    vllm.encode_front_publish(None, action.wave, action.running),
                )))
                counters["publish.wave"] += 1
                self.timeline.observe(action.wave, action.running, now)
                # The watchdog learns of the change at its next tick (O(ranks) work stays
                # off the wake path); the recorder and /debug/waves have it now.
                self._journal.record(now, KIND_WAVE, cause, rank=rank)
                out.log(DEBUG, "wave %d %s (%s)", action.wave,
                        "running" if action.running else "paused", cause)
        if actions:
            out.state_changed()
            out.refresh()

    def wake(self, frames: list[bytes], out: Outbox) -> None:
        """A START_DP_WAVE, unless the gate holds it: nothing but READY may come first."""
        if self.gate.wake(frames) is GateStep.PASS:
            out.add(Publish("back_publish", frames))
        else:
            self._journal.counters["waves.start_held_for_gate"] += 1

    def first_request(self, rank: int, stamped_wave: int, request_id: str, now: float,
                      out: Outbox) -> tuple[Action, ...]:
        """The wake a first request to a paused group needs, to send after its ADD."""
        wave_actions = self.table.on_first_request(rank, stamped_wave, now=now)
        if not wave_actions:
            return ()
        wake = Outbox()
        self.apply(wave_actions, now, wake, cause=f"first request {request_id!r}", rank=rank,
                   coordinator_wake=True)
        out.merge_flags(wake)
        return tuple(wake.actions)

    def group_changed(self, now: float, out: Outbox, *, cause: str, rank: int) -> None:
        """A rank left or was replaced: the group's wave is no longer what it ran."""
        self.apply(self.table.on_group_changed(), now, out, cause=cause, rank=rank)

    def restore(self, wave: int, *, gate_open: bool, now: float) -> None:
        """Resume at ``wave`` (paused), the gate as a previous process left it."""
        self.table = WaveState(lockstep=self._config.lockstep, wave=wave,
                               rewake_after_s=self._config.rewake_after_s)
        if gate_open:
            # Engines already passed the start-up gate; their reconnecting subscriptions
            # only get READY again, which they ignore.
            self.gate.restore_open()
            self._schedule.start(now)

    # ---- events ------------------------------------------------------------------------

    def on_engine_subscribed(self, now: float, out: Outbox) -> None:
        step = self.gate.subscribed()
        if step is GateStep.LATE_READY:
            # A late or returning engine is blocked until it sees READY.
            out.add(Publish("back_publish", (vllm.READY,)))
            out.log(INFO, "engine subscription on back_publish after start-up; sent READY",
                    key="late-subscription")
        elif step is GateStep.OPEN:
            out.state_changed()
            out.add(Publish("back_publish", (vllm.READY,)))
            held = self.gate.take_held()
            if held is not None:
                out.add(Publish("back_publish", held))
                # Only now did it leave: a pending wake counts from here.
                self.apply(self.table.on_wake_released(now), now, out,
                           cause="held wake released", rank=None)
            self._schedule.start(now)
            out.add(REARM_TIMER)
            out.log(INFO, "all %d engines subscribed; READY sent", self.gate.expected)
        else:
            out.log(INFO, "engine subscribed on back_publish (%d of %d)",
                    self.gate.subscriptions, self.gate.expected, key="subscription")

    def on_engine_unsubscribed(self, out: Outbox) -> None:
        out.log(INFO, "the last engine subscriber left back_publish", key="unsubscription")

    def on_frontend_wake(self, event: vllm.LegacyFirstRequest, now: float, out: Outbox) -> None:
        """A pre-0.33 frontend sent a request to a paused group: wake the others.

        Honoured by default, whatever the row width: a 0.29-0.32 engine given a request
        stamped with its own wave sends no ``start_wave``, so this message is the only
        thing that brings its lockstep peers in (``WaveState.on_frontend_wake``).
        ``frontend_wake=False`` drops it, as vLLM 0.33's coordinator does.
        """
        config = self._config
        if not config.frontend_wake:
            self._journal.drop(out, "front_publish", "legacy_first_request",
                               f"[{event.engine_index}, {event.wave}] (pre-0.33 frontend "
                               "wake, ignored by --frontend-wake ignore; a vLLM 0.29-0.32 MoE "
                               "group hangs without it: drop that flag)")
            return
        if event.engine_index not in self._span:
            self._journal.drop(out, "front_publish", "rank_out_of_range",
                               f"legacy wake names engine {event.engine_index}")
            return
        self._journal.counters["legacy.first_requests"] += 1
        if event.by_identity not in self._frontend_wake_forms:
            self._frontend_wake_forms.add(event.by_identity)
            who = ("a vLLM 0.29-0.32 frontend (engine named by its identity bytes)"
                   if event.by_identity else "a frontend older than vLLM 0.29 (engine index)")
            out.log(INFO, "honouring the pre-0.33 first-request wake from %s, first "
                    "[%d, %d]%s", who, event.engine_index, event.wave,
                    "" if config.lockstep else "; dense group: nothing to wake",
                    key=f"frontend-wake:{event.by_identity}")
        self.apply(self.table.on_frontend_wake(event.engine_index, event.wave, now=now), now,
                   out, cause="legacy first request", rank=event.engine_index,
                   coordinator_wake=True)

    def on_observe_timer(self, now: float, out: Outbox) -> None:
        """Retry an unanswered wake; let the watchdog judge the group's progress."""
        self.apply(self.table.on_timer(now), now, out, cause="unanswered wake retried",
                   rank=None)
        config = self._config
        wave, running = self.table.snapshot()
        # A group whose every rank is dead cannot hang in a collective: it is gone, which
        # the rank-dead logs and alerts say; a re-wake would reach nobody.
        running = running and config.lockstep and not self._all_dead()
        self.watchdog.observe_group(running=running, wave=wave, ranks=self._span.range,
                                    now=now)
        if config.watchdog_stall_s <= 0:
            return
        journal = self._journal
        for alert in self.watchdog.check(now):
            journal.counters[f"watchdog.{alert.kind}"] += 1
            journal.record(now, KIND_WATCHDOG, alert.kind, ranks=list(alert.ranks),
                           message=alert.message)
            out.log(ERROR, "WATCHDOG: %s", alert.message, event="watchdog", kind=alert.kind,
                    ranks=list(alert.ranks), wave=wave)
            for line in journal.recorder.format_lines(50, now=now):
                out.log(WARNING, "%s", line)
            if config.watchdog_rewake and alert.kind == NO_PROGRESS:
                self.wake(vllm.encode_start_dp_wave(wave, None), out)
                journal.counters["watchdog.rewakes"] += 1
                out.log(WARNING, "watchdog: re-broadcast START_DP_WAVE [%d, nil]", wave,
                        event="watchdog_rewake", wave=wave)
