"""The order in which the core's actions are carried out, written once.

The core's contract (``core.actions``) fixes an order that whoever carries
out actions must keep, and ``ActionRunner`` keeps it for the server and for
the tests' driver alike. Each action type has a *carrier*, which does the IO
(or records the action) and returns the outcome the core must hear of, or
None:

* actions are carried out in the order the core returned them;
* an outcome (``SendFailed``, ``SendSucceeded``, ``StateSaveFailed``, a KV
  action that could not be carried out) is handed to the core at once, before
  any other event, and what the core answers is carried out after the
  current actions, in its own order, and so on until nothing follows;
* a ``DispatchAdd``'s carrier sends only the ADD: if it failed, the outcome
  goes back and nothing else of it happens; if it worked, its ``wake``
  actions and then its ``reply`` are carried out right after it.

No IO here: the carriers do it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from coordinator.core.actions import Action, DispatchAdd
from coordinator.core.events import Event

Carrier = Callable[[Any], Event | None]
"""Carries out one action; returns the outcome the core must hear of, or None."""


class Handles(Protocol):
    def handle(self, event: Event, now: float) -> Sequence[Action]: ...


class ActionRunner:
    """Carries out a core's actions through ``carriers``; see the module docstring."""

    __slots__ = ("_carriers", "_clock", "_core", "_follow_ups")

    def __init__(self, core: Handles, carriers: Mapping[type, Carrier],
                 clock: Callable[[], float]) -> None:
        self._core = core
        self._carriers = dict(carriers)
        self._clock = clock
        self._follow_ups: list[Action] = []

    def run(self, actions: Sequence[Action]) -> None:
        """Carry out ``actions`` in order, then whatever the core answered to their outcomes."""
        while actions:
            for action in actions:
                self._carry(action)
            if not self._follow_ups:
                return
            actions, self._follow_ups = self._follow_ups, []

    def _carry(self, action: Action) -> None:
        outcome = self._carriers[type(action)](action)
        if outcome is not None:
            # The core learns the outcome now, before any other event; what it answers is
            # carried out once the current actions are done.
            self._follow_ups.extend(self._core.handle(outcome, self._clock()))
            return
        if type(action) is DispatchAdd:
            for then in action.wake:
                self._carry(then)
            self._carry(action.reply)
