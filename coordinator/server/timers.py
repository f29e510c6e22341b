"""The one timer: feeds the core a ``Tick`` whenever its next deadline comes.

The core owns every deadline (lease checks, the wave retry and the watchdog,
full publishes, state-file retries) and says when the next one is due
(``CoordinatorCore.next_deadline``). This task sleeps until then, or until the
core says the deadline moved earlier (``RearmTimer``, e.g. stats arrived and a
publish is now due in 100 ms instead of 5 s). It runs as its own task, so
busy sockets (whose readers yield between batches) never delay it.

Between ticks it also does the process's housekeeping, which decides nothing:
it pokes every socket reader (a safety net for a lost read edge) and gives
memory freed after a burst back to the OS.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
from collections.abc import Callable, Iterable, Mapping, Sequence

from coordinator.core.actions import Action
from coordinator.core.coordinator import CoordinatorCore
from coordinator.core.events import TICK, ServerCounters

HOUSEKEEPING_INTERVAL_S = 0.25
TRIM_EVERY = 4  # housekeeping rounds between two malloc_trim calls
# asyncio may wake a timer a little before its deadline by our clock; sleeping this
# much longer avoids a few empty rounds each time.
OVERSLEEP_S = 0.0005


def _load_malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim: Callable[[int], int] = libc.malloc_trim
    except (OSError, AttributeError):
        return None  # not glibc
    return trim


_malloc_trim = _load_malloc_trim()


def release_free_memory() -> None:
    """Give memory freed after a burst back to the OS (glibc keeps it otherwise:
    a backlog of stats messages can leave the process at twice its working size)."""
    if _malloc_trim is not None:
        _malloc_trim(0)


class CoreTimer:
    """Ticks the core at its deadlines; ``rearm()`` when the deadline may be earlier."""

    def __init__(
        self,
        core: CoordinatorCore,
        execute: Callable[[Sequence[Action]], None],
        *,
        clock: Callable[[], float],
        on_error: Callable[[str, BaseException], None],
        pokes: Callable[[], Iterable[Callable[[], None]]] = tuple,
        server_counters: Callable[[], Mapping[str, int]] = dict,
    ) -> None:
        self._core = core
        self._execute = execute
        self._clock = clock
        self._on_error = on_error
        self._pokes = pokes
        self._server_counters = server_counters
        self._counters_fed: Mapping[str, int] = {}
        self._rearmed = asyncio.Event()
        self._next_housekeeping = 0.0
        self._rounds = 0

    def rearm(self) -> None:
        self._rearmed.set()

    def tick(self) -> None:
        """Feed one ``Tick`` now; a bug in the core is counted and the timer goes on."""
        try:
            counters = self._server_counters()
            if counters != self._counters_fed:
                # The server's own counters reach the core's views as an event.
                self._counters_fed = counters
                self._execute(self._core.handle(ServerCounters(dict(counters)), self._clock()))
            self._execute(self._core.handle(TICK, self._clock()))
        except Exception as exc:
            self._on_error("timer", exc)

    async def run(self) -> None:
        while True:
            self.tick()
            now = self._clock()
            if now >= self._next_housekeeping:
                self._next_housekeeping = now + HOUSEKEEPING_INTERVAL_S
                self._housekeeping()
            delay = self._core.next_deadline() - self._clock()
            if delay <= 0:
                await asyncio.sleep(0)  # still due: let the readers have a turn first
                continue
            self._rearmed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._rearmed.wait(), delay + OVERSLEEP_S)

    def _housekeeping(self) -> None:
        for poke in self._pokes():
            poke()
        self._rounds += 1
        if self._rounds % TRIM_EVERY == 0:
            release_free_memory()
