"""Wave state of a lockstep (MoE) data-parallel group, as the coordinator sees it.

Theory of operation
-------------------
Engines of a lockstep group step together: while any of them has work, all of
them step (idle ones run dummy batches) so that their collectives match. vLLM
calls one such stretch of stepping a *wave* and numbers the waves. The
coordinator keeps two facts about the group:

* ``current_wave``: the number of the wave that is running, or the next one to
  run when the group is paused. It never goes back.
* ``running``: whether an engine has *told* us that the current wave started.
  It is an observation, never a guess: only an engine's ``start_wave`` report
  sets it; ``wave_complete`` from rank 0, or a report of a later wave, clears it.

Four kinds of event reach this machine. Each is first classified against the
state into one condition (the ``classify_*`` functions), then looked up in
``TRANSITIONS``, which says what the new state is and what to send:

* ``wave_complete(w)`` from rank 0: the group went idle at the end of wave
  ``w``. Unless it is stale, the group is now paused before wave ``w + 1``.
* ``start_wave(w)`` from any engine: an idle engine got a request and began
  wave ``w`` (it marked itself running before reporting, so it is left out of
  the wake). The coordinator relays the wake to every other engine with
  ``START_DP_WAVE [w, sender]`` unless the report is stale, already known, or
  answers a live wake the coordinator itself sent for exactly that wave.
* ``first_request``: the coordinator itself dispatches a request. If the group
  is paused and no live wake is out for the current wave, *every* engine gets
  ``START_DP_WAVE [current, None]`` at once, instead of waiting for the chosen
  engine's report to make a round trip. ``running`` stays as it is until an
  engine reports.
* ``reported_wave(w)``: the ``current_wave`` of an engine's stats report.

Why a coordinator wake excludes nobody
    The chosen engine may drop the ADD without starting: the request fails
    validation, the engine is shutting down, or its scheduler is paused. Had
    the wake left it out, its woken peers would block in their first
    collective with nobody to match them. Including it costs nothing: an
    engine that already started on the ADD ignores the wake, and the chosen
    engine's report (or rank 0's mirror report after its first step) still
    tells us that the wave started.

Requests stamped with another wave
    A frontend stamps each request with the last wave it heard. An older stamp
    changes nothing here (the engine keeps its newer wave and the wake names
    ours). A stamp *newer* than ours means the frontend heard a wave we never
    saw, for instance because this process restarted: the wave is adopted
    first (still paused, and published), and the wake names that wave, since
    engines ignore a ``START_DP_WAVE`` older than their own wave.

Why a pending wake expires
    A wake that was sent is not one that was delivered: paused engines drop
    ``START_DP_WAVE``, and the publish socket drops messages at its high-water
    mark or across a reconnect. While a wake for the current wave is pending,
    further first requests send nothing and an engine's ``start_wave`` for
    that wave is not relayed, so that concurrent first requests cost one wake
    per wave. A pending wake therefore counts only for ``rewake_after_s``
    after it was sent (when the caller passes ``now``). After that, a later
    first request wakes again and an engine's ``start_wave`` is relayed as
    vLLM does, so one lost wake cannot silence the wave for good. Normally an
    engine reports within milliseconds, which clears the pending wake, and
    there is still exactly one wake per wave.

A wake held at the start-up gate
    Engines assert that ``READY`` is the first thing on ``back_publish``, so a
    wake decided before the start-up gate opened is held there
    (``core.waves.gate``) and leaves only when the gate opens. Until then it
    was not sent, so its ``rewake_after_s`` has not begun: the caller says
    when it left (``on_wake_released``), and the pending wake counts from
    then. A retry made while it was held reached nobody either, so the retry
    is still owed once the wake is out.

A rank that dies or is replaced
    The wave a group is stepping in cannot finish once one of its ranks is
    gone, and a replacement starts idle at wave 0. ``on_group_changed`` marks
    the group paused at the current wave (published) and forgets any pending
    wake, so the next request wakes everyone and the new engines' reports are
    relayed instead of being taken for news about a wave already running.

A wake nobody answers
    If a wake expires and still no engine has reported the wave, the chosen
    engine may have dropped its request while some peers lost the wake, which
    leaves the group split. ``on_timer`` then wakes everyone once more (once
    per wave); a group that stays silent after that is the hang watchdog's
    business.

Why a reported wave above ours is adopted
    Engines advance their wave only together, when the all-reduce says the
    whole group went idle (or by adopting a newer stamp, which came from a
    wave the coordinator published). An engine reporting wave ``w`` greater
    than ours therefore proves that every earlier wave ended: the group is
    paused at ``w`` until some engine reports ``start_wave``. This is how a
    restarted coordinator, back at wave 0, rebuilds the wave from the
    engines' stats without ever moving it back. In normal operation it can
    only run ahead of rank 0's ``wave_complete(w - 1)``, which says the same
    thing, and never hides a start we heard of: an engine's stats for a wave
    it started itself follow its own ``start_wave`` on the same
    first-in-first-out socket, and stats for a wave it joined on our
    broadcast follow that broadcast, so in both cases the wave is no longer
    newer than ours when the stats arrive. A ``start_wave(w)`` still on its
    way finds the group paused at ``w`` and is accepted as usual.

The two engine reports come over different engines' sockets and can arrive in
either order; both orders of ``wave_complete(W)`` and ``start_wave(W + 1)``
end in wave ``W + 1``, running, with one wake sent.

In dense mode (``lockstep=False``) engines never step together, there are no
waves, and every method returns no actions and leaves the state untouched.

This module does no IO and reads no clock: time comes in as ``now``
(monotonic seconds) and methods return the actions the caller must perform,
in order.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeAlias


@dataclass(frozen=True)
class BroadcastStartWave:
    """Send ``START_DP_WAVE [wave, exclude]`` to every engine on the back publish socket."""

    wave: int
    exclude: int | None


@dataclass(frozen=True)
class PublishWave:
    """Publish ``[nil, wave, running]`` to every frontend now."""

    wave: int
    running: bool


WaveAction: TypeAlias = BroadcastStartWave | PublishWave


class WaveEvent(enum.Enum):
    """What happened."""

    WAVE_COMPLETE = "wave_complete"
    START_WAVE = "start_wave"
    FIRST_REQUEST = "first_request"
    REPORTED_WAVE = "reported_wave"
    TIMER = "timer"
    GROUP_CHANGED = "group_changed"
    WAKE_RELEASED = "wake_released"  # the start-up gate let the held wake out


class WaveCondition(enum.Enum):
    """How an event relates to the current state (``w`` is the reported or stamped wave).

    "Live wake" means a coordinator wake for the current wave that has not expired.
    """

    STALE = "stale"  # w < current
    CURRENT = "current"  # w == current (reported_wave)
    NEWER = "newer"  # w > current
    CURRENT_OR_NEWER = "current_or_newer"  # w >= current (wave_complete)
    CURRENT_RUNNING = "current_running"  # w == current, already running
    CURRENT_PAUSED = "current_paused"  # w == current, paused, no live wake
    CURRENT_PAUSED_WOKEN = "current_paused_woken"  # w == current, paused, live wake
    RUNNING = "running"  # group running: a request needs no wake
    WAKE_SENT = "wake_sent"  # paused, live wake, stamp not newer than current
    PAUSED = "paused"  # paused, no live wake, stamp not newer than current
    PAUSED_NEWER_STAMP = "paused_newer_stamp"  # paused, stamp newer than current
    GROUP_RUNNING = "group_running"  # group_changed while running
    GROUP_PAUSED = "group_paused"  # group_changed while paused
    NOTHING_DUE = "nothing_due"  # timer: no unanswered coordinator wake to retry
    WAKE_UNANSWERED = "wake_unanswered"  # timer: our wake expired, no engine reported, once
    OUR_WAKE_RELEASED = "our_wake_released"  # wake_released: it is our pending wake
    NO_WAKE_PENDING = "no_wake_pending"  # wake_released: a relay, or an engine report came


class WaveUpdate(enum.Enum):
    KEEP = "keep"
    REPORTED = "reported"  # current := w (reported or stamped)
    AFTER_REPORTED = "after_reported"  # current := w + 1


class WakeUpdate(enum.Enum):
    KEEP = "keep"
    CLEAR = "clear"  # an engine report superseded any wake we sent
    MARK_CURRENT = "mark_current"  # we are sending the wake for the current wave, now
    SENT_NOW = "sent_now"  # the pending wake left only now: it counts, and may be retried, anew


class Exclude(enum.Enum):
    SENDER = "sender"  # the engine whose start_wave report is relayed
    NOBODY = "nobody"


@dataclass(frozen=True)
class Transition:
    """One row of the table. ``running=None`` keeps the flag; ``broadcast=None`` sends no wake."""

    running: bool | None
    wave: WaveUpdate
    wake: WakeUpdate
    broadcast: Exclude | None
    publish: bool


_IGNORE = Transition(
    running=None, wave=WaveUpdate.KEEP, wake=WakeUpdate.KEEP, broadcast=None, publish=False
)
_ENGINE_STARTED_WAVE = Transition(
    running=True,
    wave=WaveUpdate.REPORTED,
    wake=WakeUpdate.CLEAR,
    broadcast=Exclude.SENDER,
    publish=True,
)

_E = WaveEvent
_C = WaveCondition

TRANSITIONS: Mapping[tuple[WaveEvent, WaveCondition], Transition] = {
    (_E.WAVE_COMPLETE, _C.STALE): _IGNORE,
    (_E.WAVE_COMPLETE, _C.CURRENT_OR_NEWER): Transition(
        running=False,
        wave=WaveUpdate.AFTER_REPORTED,
        wake=WakeUpdate.CLEAR,
        broadcast=None,
        publish=True,
    ),
    (_E.START_WAVE, _C.STALE): _IGNORE,
    (_E.START_WAVE, _C.CURRENT_RUNNING): _IGNORE,
    (_E.START_WAVE, _C.NEWER): _ENGINE_STARTED_WAVE,
    # Also taken when our own wake for this wave expired: it may never have arrived.
    (_E.START_WAVE, _C.CURRENT_PAUSED): _ENGINE_STARTED_WAVE,
    # Our own wake for this wave went to every engine moments ago: the report
    # only confirms that the wave started.
    (_E.START_WAVE, _C.CURRENT_PAUSED_WOKEN): Transition(
        running=True,
        wave=WaveUpdate.REPORTED,
        wake=WakeUpdate.CLEAR,
        broadcast=None,
        publish=True,
    ),
    (_E.FIRST_REQUEST, _C.RUNNING): _IGNORE,
    (_E.FIRST_REQUEST, _C.WAKE_SENT): _IGNORE,
    # Whatever the (older or current) stamp, wake everyone at our wave.
    (_E.FIRST_REQUEST, _C.PAUSED): Transition(
        running=None,
        wave=WaveUpdate.KEEP,
        wake=WakeUpdate.MARK_CURRENT,
        broadcast=Exclude.NOBODY,
        publish=False,
    ),
    # The frontend heard of a later wave than we did (we restarted): adopt it,
    # still paused, and wake everyone at that wave.
    (_E.FIRST_REQUEST, _C.PAUSED_NEWER_STAMP): Transition(
        running=None,
        wave=WaveUpdate.REPORTED,
        wake=WakeUpdate.MARK_CURRENT,
        broadcast=Exclude.NOBODY,
        publish=True,
    ),
    # A rank died or was replaced: the wave it was stepping in can no longer finish
    # as it was (its replacement starts idle at wave 0), so the group counts as
    # paused at the current wave; the next request or engine report wakes everyone,
    # and a wake still pending was meant for the old group.
    (_E.GROUP_CHANGED, _C.GROUP_RUNNING): Transition(
        running=False,
        wave=WaveUpdate.KEEP,
        wake=WakeUpdate.CLEAR,
        broadcast=None,
        publish=True,
    ),
    (_E.GROUP_CHANGED, _C.GROUP_PAUSED): Transition(
        running=None,
        wave=WaveUpdate.KEEP,
        wake=WakeUpdate.CLEAR,
        broadcast=None,
        publish=False,
    ),
    (_E.TIMER, _C.NOTHING_DUE): _IGNORE,
    # Our wake expired and no engine said the wave started: some engine may have
    # lost it while the chosen one dropped the request, leaving the group split.
    # Wake everyone once more; a second silence is left to the hang watchdog.
    (_E.TIMER, _C.WAKE_UNANSWERED): Transition(
        running=None,
        wave=WaveUpdate.KEEP,
        wake=WakeUpdate.MARK_CURRENT,
        broadcast=Exclude.NOBODY,
        publish=False,
    ),
    # The held wake is out only now: the pending wake counts from now, and the retry
    # the timer may have made while it was held reached nobody.
    (_E.WAKE_RELEASED, _C.OUR_WAKE_RELEASED): Transition(
        running=None,
        wave=WaveUpdate.KEEP,
        wake=WakeUpdate.SENT_NOW,
        broadcast=None,
        publish=False,
    ),
    # What left was a relay of an engine's start, or an engine reported since: there
    # is no wake of ours to count.
    (_E.WAKE_RELEASED, _C.NO_WAKE_PENDING): _IGNORE,
    (_E.REPORTED_WAVE, _C.STALE): _IGNORE,
    (_E.REPORTED_WAVE, _C.CURRENT): _IGNORE,
    # Every earlier wave ended; the group waits at this one for a start_wave.
    (_E.REPORTED_WAVE, _C.NEWER): Transition(
        running=False,
        wave=WaveUpdate.REPORTED,
        wake=WakeUpdate.CLEAR,
        broadcast=None,
        publish=True,
    ),
}


def classify_timer(
    current: int,
    running: bool,
    pending_for: int | None,
    live: int | None,
    retried_for: int | None,
) -> WaveCondition:
    """``live`` is the pending wake after expiry; ``retried_for`` the wave already retried."""
    if running or pending_for != current or live is not None or retried_for == current:
        return WaveCondition.NOTHING_DUE
    return WaveCondition.WAKE_UNANSWERED


def live_wake(
    pending_for: int | None, sent_at: float | None, now: float | None, rewake_after_s: float
) -> int | None:
    """The wave of a pending wake if it still counts at ``now``, else None.

    A wake sent without a time, or asked about without one, never expires.
    """
    if pending_for is None:
        return None
    if now is None or sent_at is None or now - sent_at < rewake_after_s:
        return pending_for
    return None


def classify_wake_released(pending_for: int | None) -> WaveCondition:
    if pending_for is None:
        return WaveCondition.NO_WAKE_PENDING
    return WaveCondition.OUR_WAKE_RELEASED


def classify_wave_complete(current: int, reported: int) -> WaveCondition:
    return WaveCondition.STALE if reported < current else WaveCondition.CURRENT_OR_NEWER


def classify_start_wave(
    current: int, running: bool, live_wake_for: int | None, reported: int
) -> WaveCondition:
    if reported < current:
        return WaveCondition.STALE
    if reported > current:
        return WaveCondition.NEWER
    if running:
        return WaveCondition.CURRENT_RUNNING
    if live_wake_for == reported:
        return WaveCondition.CURRENT_PAUSED_WOKEN
    return WaveCondition.CURRENT_PAUSED


def classify_first_request(
    current: int, running: bool, live_wake_for: int | None, stamped: int
) -> WaveCondition:
    if running:
        return WaveCondition.RUNNING
    if stamped > current:
        return WaveCondition.PAUSED_NEWER_STAMP
    if live_wake_for == current:
        return WaveCondition.WAKE_SENT
    return WaveCondition.PAUSED


def classify_reported_wave(current: int, reported: int) -> WaveCondition:
    if reported < current:
        return WaveCondition.STALE
    if reported > current:
        return WaveCondition.NEWER
    return WaveCondition.CURRENT


class WaveState:
    """The coordinator's view of the group's waves; feed it events, perform what it returns."""

    def __init__(
        self,
        *,
        lockstep: bool = True,
        wave: int = 0,
        running: bool = False,
        rewake_after_s: float = 1.0,
    ) -> None:
        if not rewake_after_s >= 0.0:  # also refuses NaN
            raise ValueError(f"rewake_after_s must be >= 0, got {rewake_after_s!r}")
        self.lockstep = lockstep
        self.rewake_after_s = rewake_after_s
        self._wave = wave
        self._running = running
        self._wake_pending_for: int | None = None
        self._wake_sent_at: float | None = None
        self._wake_retried_for: int | None = None

    @property
    def current_wave(self) -> int:
        return self._wave

    @property
    def running(self) -> bool:
        return self._running

    @property
    def wake_pending_for(self) -> int | None:
        """The wave the coordinator woke the group for, until an engine reports on it.

        Raw: an expired wake is still shown; ``wake_pending(now)`` applies expiry.
        """
        return self._wake_pending_for

    def wake_pending(self, now: float | None) -> int | None:
        """The wave of a pending wake that still suppresses wakes and relays at ``now``."""
        return live_wake(self._wake_pending_for, self._wake_sent_at, now, self.rewake_after_s)

    def snapshot(self) -> tuple[int, bool]:
        return self._wave, self._running

    def on_engine_output(
        self,
        rank: int,
        wave_complete: int | None,
        start_wave: int | None,
        *,
        now: float | None = None,
    ) -> list[WaveAction]:
        """One engine output message; a ``wave_complete`` in it hides any ``start_wave``."""
        if wave_complete is not None:
            return self.on_wave_complete(rank, wave_complete)
        if start_wave is not None:
            return self.on_start_wave(rank, start_wave, now=now)
        return []

    def on_wave_complete(self, rank: int, wave: int) -> list[WaveAction]:
        if not self.lockstep:
            return []
        condition = classify_wave_complete(self._wave, wave)
        return self._apply(TRANSITIONS[WaveEvent.WAVE_COMPLETE, condition], wave, rank, None)

    def on_start_wave(self, rank: int, wave: int, *, now: float | None = None) -> list[WaveAction]:
        if not self.lockstep:
            return []
        condition = classify_start_wave(self._wave, self._running, self.wake_pending(now), wave)
        return self._apply(TRANSITIONS[WaveEvent.START_WAVE, condition], wave, rank, now)

    def on_first_request(
        self, chosen: int, stamped_wave: int, *, now: float | None = None
    ) -> list[WaveAction]:
        """Called for every request the coordinator dispatches to engine ``chosen``."""
        if not self.lockstep or self._running:
            return []  # the RUNNING row, without the lookup: most requests land here
        condition = classify_first_request(
            self._wave, self._running, self.wake_pending(now), stamped_wave
        )
        return self._apply(
            TRANSITIONS[WaveEvent.FIRST_REQUEST, condition], stamped_wave, chosen, now
        )

    def on_frontend_wake(
        self, chosen: int, stamped_wave: int, *, now: float | None = None
    ) -> list[WaveAction]:
        """A pre-0.33 frontend's first-request wake ``[engine, stamped_wave]``.

        vLLM 0.29-0.32 engines send ``start_wave`` only for a request stamped with an
        older wave, so after a pause the first request's engine starts alone and only
        this message wakes its lockstep peers. Those versions' coordinators answer it,
        while paused, with ``START_DP_WAVE`` for the current wave, excluding nobody
        (a stale stamp sends nil; a current one sends the identity bytes, which no
        engine's int index equals). The rule is the coordinator's own first request:
        ``[current, nil]`` once per wave, a stale stamp wakes the current wave, a newer
        one is adopted first; running flips only on an engine's report (vLLM's
        #51476 fix), and a dense group sends nothing.
        """
        return self.on_first_request(chosen, stamped_wave, now=now)

    def on_group_changed(self) -> list[WaveAction]:
        """A rank left the group or a new incarnation took it over."""
        if not self.lockstep:
            return []
        condition = WaveCondition.GROUP_RUNNING if self._running else WaveCondition.GROUP_PAUSED
        return self._apply(TRANSITIONS[WaveEvent.GROUP_CHANGED, condition], self._wave, -1, None)

    def on_timer(self, now: float) -> list[WaveAction]:
        """Called periodically: retries, once per wave, a wake nobody answered."""
        if not self.lockstep:
            return []
        condition = classify_timer(
            self._wave, self._running, self._wake_pending_for, self.wake_pending(now),
            self._wake_retried_for,
        )
        if condition is WaveCondition.WAKE_UNANSWERED:
            self._wake_retried_for = self._wave
        return self._apply(TRANSITIONS[WaveEvent.TIMER, condition], self._wave, -1, now)

    def on_wake_released(self, now: float) -> list[WaveAction]:
        """The start-up gate opened and sent the wake it held, at ``now``."""
        if not self.lockstep:
            return []
        condition = classify_wake_released(self._wake_pending_for)
        return self._apply(TRANSITIONS[WaveEvent.WAKE_RELEASED, condition], self._wave, -1, now)

    def on_reported_wave(self, rank: int, wave: int) -> list[WaveAction]:
        """The ``current_wave`` of a stats report from engine ``rank``."""
        if not self.lockstep or wave <= self._wave:
            return []  # the STALE and CURRENT rows, without the lookup: every report lands here
        condition = classify_reported_wave(self._wave, wave)
        return self._apply(TRANSITIONS[WaveEvent.REPORTED_WAVE, condition], wave, rank, None)

    def _apply(
        self, row: Transition, reported: int, sender: int, now: float | None
    ) -> list[WaveAction]:
        if row.wave is WaveUpdate.REPORTED:
            self._wave = max(self._wave, reported)
        elif row.wave is WaveUpdate.AFTER_REPORTED:
            self._wave = max(self._wave, reported + 1)
        if row.running is not None:
            self._running = row.running
        if row.wake is WakeUpdate.CLEAR:
            self._wake_pending_for = None
            self._wake_sent_at = None
        elif row.wake is WakeUpdate.MARK_CURRENT:
            self._wake_pending_for = self._wave
            self._wake_sent_at = now
        elif row.wake is WakeUpdate.SENT_NOW:
            self._wake_sent_at = now
            if self._wake_retried_for == self._wave:
                self._wake_retried_for = None

        actions: list[WaveAction] = []
        if row.broadcast is not None:
            exclude = sender if row.broadcast is Exclude.SENDER else None
            actions.append(BroadcastStartWave(self._wave, exclude))
        if row.publish:
            actions.append(PublishWave(self._wave, self._running))
        return actions
