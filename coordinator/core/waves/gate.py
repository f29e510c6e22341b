"""The start-up gate on ``back_publish``, and the wake held behind it.

Theory of operation
-------------------
A vLLM engine subscribes to ``back_publish`` after its handshake and then
blocks until the first message there is ``READY``; it asserts that nothing
else comes first. vLLM's own coordinator sends ``READY`` once as many
subscriptions arrived as the group has engines, and this gate does the same:
it counts subscriptions (not handshakes, so engines that handshook with
someone else, e.g. vLLM's launcher, are counted too) and opens when the count
reaches ``expected``.

Two things follow from the assertion:

* A wake (``START_DP_WAVE``) decided while the gate is closed must not go out.
  The gate *holds* it instead, keeping only the newest (a later wake names a
  wave at least as new, which is the one engines need), and releases it right
  after ``READY`` when the gate opens.
* An engine that subscribes after the gate opened (a late or restarted engine)
  is blocked until it sees ``READY`` too, so every later subscription gets one
  more ``READY``. Engines already past the gate ignore it.

An unsubscription changes nothing: libzmq reports only the last subscriber
leaving, and a returning engine subscribes again.

``GATE`` is the whole machine: ``(state, event) -> (next state, step)``; the
caller performs the step. ``expected`` follows the group's size (an elastic
resize changes it); a smaller ``expected`` opens the gate only at the next
subscription, as in vLLM. A coordinator restored from its state file starts
with the gate open (its engines passed it before).

No IO, no clock: the caller sends ``READY`` and the released wake.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence


class GateState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"


class GateEvent(enum.Enum):
    SUBSCRIBED_SHORT = "subscribed_short"  # a subscription, still fewer than expected
    SUBSCRIBED_ENOUGH = "subscribed_enough"  # a subscription that reaches expected
    WAKE = "wake"  # a START_DP_WAVE is to be sent


class GateStep(enum.Enum):
    COUNT = "count"  # nothing to send yet
    OPEN = "open"  # send READY, then the held wake if any
    LATE_READY = "late_ready"  # send READY for a subscriber that came after opening
    HOLD = "hold"  # keep the wake (replacing an older held one) until the gate opens
    PASS = "pass"  # send the wake now


_S = GateState
_E = GateEvent

GATE: Mapping[tuple[GateState, GateEvent], tuple[GateState, GateStep]] = {
    (_S.CLOSED, _E.SUBSCRIBED_SHORT): (_S.CLOSED, GateStep.COUNT),
    (_S.CLOSED, _E.SUBSCRIBED_ENOUGH): (_S.OPEN, GateStep.OPEN),
    (_S.CLOSED, _E.WAKE): (_S.CLOSED, GateStep.HOLD),
    (_S.OPEN, _E.SUBSCRIBED_SHORT): (_S.OPEN, GateStep.LATE_READY),
    (_S.OPEN, _E.SUBSCRIBED_ENOUGH): (_S.OPEN, GateStep.LATE_READY),
    (_S.OPEN, _E.WAKE): (_S.OPEN, GateStep.PASS),
}


class StartGate:
    """Counts engine subscriptions on ``back_publish`` and holds wakes until it opens."""

    def __init__(self, expected: int) -> None:
        if expected < 1:
            raise ValueError(f"the gate needs at least one engine, got {expected}")
        self.expected = expected
        self._state = GateState.CLOSED
        self._subscriptions = 0
        self._held: list[bytes] | None = None

    @property
    def is_open(self) -> bool:
        return self._state is GateState.OPEN

    @property
    def subscriptions(self) -> int:
        return self._subscriptions

    @property
    def held_wake(self) -> list[bytes] | None:
        """The frames of the wake waiting for the gate, if any."""
        return self._held

    def subscribed(self) -> GateStep:
        """An engine subscribed on ``back_publish``."""
        self._subscriptions += 1
        enough = self._subscriptions >= self.expected
        event = GateEvent.SUBSCRIBED_ENOUGH if enough else GateEvent.SUBSCRIBED_SHORT
        self._state, step = GATE[self._state, event]
        return step

    def wake(self, frames: Sequence[bytes]) -> GateStep:
        """A wake is due; HOLD keeps it (the newest only), PASS means send it now."""
        self._state, step = GATE[self._state, GateEvent.WAKE]
        if step is GateStep.HOLD:
            self._held = list(frames)
        return step

    def take_held(self) -> list[bytes] | None:
        """The held wake, once: call right after an OPEN step."""
        held, self._held = self._held, None
        return held

    def restore_open(self) -> None:
        """Resume with the gate open (a previous process opened it; see the state file)."""
        self._state = GateState.OPEN
        self._subscriptions = max(self._subscriptions, self.expected)
