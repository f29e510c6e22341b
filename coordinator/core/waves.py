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
  sets it, and only rank 0's ``wave_complete`` report clears it.

Three kinds of event reach this machine, and each is first classified against
the state into one condition (the ``classify_*`` functions), then looked up in
``TRANSITIONS``, which says what the new state is and what to send:

* ``wave_complete(w)`` from rank 0: the group went idle at the end of wave
  ``w``. Unless it is stale, the group is now paused before wave ``w + 1``.
* ``start_wave(w)`` from any engine: an idle engine got a request and began
  wave ``w`` (it marked itself running before reporting, so it is left out of
  the wake). The coordinator relays the wake to every other engine with
  ``START_DP_WAVE [w, sender]`` unless the report is stale, already known, or
  answers a wake the coordinator itself sent for exactly that wave.
* ``first_request``: the coordinator itself dispatches a request. If the group
  is paused and nobody has been woken for the current wave, every engine but
  the chosen one gets ``START_DP_WAVE [current, chosen]`` at once, instead of
  waiting for the chosen engine's report to make a round trip. A request
  stamped with an older wave wakes everyone (``exclude = None``). Either way
  ``running`` stays as it is until an engine reports.

The two engine reports come over different engines' sockets and can arrive in
either order; both orders of ``wave_complete(W)`` and ``start_wave(W + 1)``
end in wave ``W + 1``, running, with one wake sent.

In dense mode (``lockstep=False``) engines never step together, there are no
waves, and every method returns no actions and leaves the state untouched.

This module does no IO and reads no clock: methods return the actions the
caller must perform, in order.
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


class WaveCondition(enum.Enum):
    """How an event relates to the current state (``w`` is the reported wave)."""

    STALE = "stale"  # w < current
    NEWER = "newer"  # w > current
    CURRENT_OR_NEWER = "current_or_newer"  # w >= current (wave_complete)
    CURRENT_RUNNING = "current_running"  # w == current, already running
    CURRENT_PAUSED = "current_paused"  # w == current, paused, no wake sent for it
    CURRENT_PAUSED_WOKEN = "current_paused_woken"  # w == current, paused, wake sent
    RUNNING = "running"  # group running: a request needs no wake
    WAKE_SENT = "wake_sent"  # paused, but this wave's wake already went out
    PAUSED = "paused"  # paused, request stamped with the current (or a later) wave
    PAUSED_STALE_STAMP = "paused_stale_stamp"  # paused, request stamped with an older wave


class WaveUpdate(enum.Enum):
    KEEP = "keep"
    REPORTED = "reported"  # current := w
    AFTER_REPORTED = "after_reported"  # current := w + 1


class WakeUpdate(enum.Enum):
    KEEP = "keep"
    CLEAR = "clear"  # an engine report superseded any wake we sent
    MARK_CURRENT = "mark_current"  # we are sending the wake for the current wave


class Exclude(enum.Enum):
    SENDER = "sender"  # the reporting engine, or the engine chosen for the request
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
    (_E.START_WAVE, _C.CURRENT_PAUSED): _ENGINE_STARTED_WAVE,
    # Our own wake for this wave is already on its way to every other engine:
    # the report only confirms that the wave started.
    (_E.START_WAVE, _C.CURRENT_PAUSED_WOKEN): Transition(
        running=True,
        wave=WaveUpdate.REPORTED,
        wake=WakeUpdate.CLEAR,
        broadcast=None,
        publish=True,
    ),
    (_E.FIRST_REQUEST, _C.RUNNING): _IGNORE,
    (_E.FIRST_REQUEST, _C.WAKE_SENT): _IGNORE,
    (_E.FIRST_REQUEST, _C.PAUSED): Transition(
        running=None,
        wave=WaveUpdate.KEEP,
        wake=WakeUpdate.MARK_CURRENT,
        broadcast=Exclude.SENDER,
        publish=False,
    ),
    # The frontend had not seen the last wave end, so the chosen engine may
    # treat the request as belonging to an old wave: wake it too.
    (_E.FIRST_REQUEST, _C.PAUSED_STALE_STAMP): Transition(
        running=None,
        wave=WaveUpdate.KEEP,
        wake=WakeUpdate.MARK_CURRENT,
        broadcast=Exclude.NOBODY,
        publish=False,
    ),
}


def classify_wave_complete(current: int, reported: int) -> WaveCondition:
    return WaveCondition.STALE if reported < current else WaveCondition.CURRENT_OR_NEWER


def classify_start_wave(
    current: int, running: bool, wake_pending_for: int | None, reported: int
) -> WaveCondition:
    if reported < current:
        return WaveCondition.STALE
    if reported > current:
        return WaveCondition.NEWER
    if running:
        return WaveCondition.CURRENT_RUNNING
    if wake_pending_for == reported:
        return WaveCondition.CURRENT_PAUSED_WOKEN
    return WaveCondition.CURRENT_PAUSED


def classify_first_request(
    current: int, running: bool, wake_pending_for: int | None, stamped: int
) -> WaveCondition:
    if running:
        return WaveCondition.RUNNING
    if wake_pending_for == current:
        return WaveCondition.WAKE_SENT
    if stamped < current:
        return WaveCondition.PAUSED_STALE_STAMP
    return WaveCondition.PAUSED


class WaveState:
    """The coordinator's view of the group's waves; feed it events, perform what it returns."""

    def __init__(self, *, lockstep: bool = True, wave: int = 0, running: bool = False) -> None:
        self.lockstep = lockstep
        self._wave = wave
        self._running = running
        self._wake_pending_for: int | None = None

    @property
    def current_wave(self) -> int:
        return self._wave

    @property
    def running(self) -> bool:
        return self._running

    @property
    def wake_pending_for(self) -> int | None:
        """The wave the coordinator woke the group for, until an engine reports it started."""
        return self._wake_pending_for

    def snapshot(self) -> tuple[int, bool]:
        return self._wave, self._running

    def on_engine_output(
        self, rank: int, wave_complete: int | None, start_wave: int | None
    ) -> list[WaveAction]:
        """One engine output message; a ``wave_complete`` in it hides any ``start_wave``."""
        if wave_complete is not None:
            return self.on_wave_complete(rank, wave_complete)
        if start_wave is not None:
            return self.on_start_wave(rank, start_wave)
        return []

    def on_wave_complete(self, rank: int, wave: int) -> list[WaveAction]:
        if not self.lockstep:
            return []
        condition = classify_wave_complete(self._wave, wave)
        return self._apply(TRANSITIONS[WaveEvent.WAVE_COMPLETE, condition], wave, rank)

    def on_start_wave(self, rank: int, wave: int) -> list[WaveAction]:
        if not self.lockstep:
            return []
        condition = classify_start_wave(self._wave, self._running, self._wake_pending_for, wave)
        return self._apply(TRANSITIONS[WaveEvent.START_WAVE, condition], wave, rank)

    def on_first_request(self, chosen: int, stamped_wave: int) -> list[WaveAction]:
        """Called for every request the coordinator dispatches to engine ``chosen``."""
        if not self.lockstep:
            return []
        condition = classify_first_request(
            self._wave, self._running, self._wake_pending_for, stamped_wave
        )
        return self._apply(TRANSITIONS[WaveEvent.FIRST_REQUEST, condition], self._wave, chosen)

    def _apply(self, row: Transition, reported: int, sender: int) -> list[WaveAction]:
        if row.wave is WaveUpdate.REPORTED:
            self._wave = max(self._wave, reported)
        elif row.wave is WaveUpdate.AFTER_REPORTED:
            self._wave = max(self._wave, reported + 1)
        if row.running is not None:
            self._running = row.running
        if row.wake is WakeUpdate.CLEAR:
            self._wake_pending_for = None
        elif row.wake is WakeUpdate.MARK_CURRENT:
            self._wake_pending_for = self._wave

        actions: list[WaveAction] = []
        if row.broadcast is not None:
            exclude = sender if row.broadcast is Exclude.SENDER else None
            actions.append(BroadcastStartWave(self._wave, exclude))
        if row.publish:
            actions.append(PublishWave(self._wave, self._running))
        return actions
