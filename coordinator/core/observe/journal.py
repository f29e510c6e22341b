"""What every domain writes down: counters, the flight recorder, dropped input.

One ``Journal`` is shared by the domains of a core. Counters are plain data
(``counters`` by name, plus the few hot ones the core keeps as ints, merged by
``observe.views.counter_values``); the flight recorder stamps each entry with
the group's wave, read from the wave table through ``wave_of``, so that the
recorder needs no reference to the wave domain.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from logging import WARNING

from coordinator.core.actions import SocketName
from coordinator.core.observe.recorder import FlightRecorder
from coordinator.core.outbox import Outbox


class Journal:
    """Counters and the recorder; see the module docstring."""

    __slots__ = ("_wave_of", "counters", "recorder")

    def __init__(self, recorder: FlightRecorder,
                 wave_of: Callable[[], tuple[int, bool]]) -> None:
        self.counters: Counter[str] = Counter()
        self.recorder = recorder
        self._wave_of = wave_of

    def record(self, now: float, kind: str, cause: str, *, rank: int | None = None,
               **detail: object) -> None:
        wave, running = self._wave_of()
        self.recorder.record(at=now, kind=kind, cause=cause, wave=wave, running=running,
                             rank=rank, **detail)

    def drop(self, out: Outbox, socket: SocketName, reason: str, detail: str,
             peer: str = "") -> None:
        """Count and (rate-limited) log one piece of bad input; state is untouched."""
        self.counters[f"dropped.{socket}.{reason}"] += 1
        out.log(WARNING, "dropped bad input on %s%s (%s): %s", socket,
                f" from {peer}" if peer else "", reason, detail,
                key=f"{socket}:{reason}:{peer}")
