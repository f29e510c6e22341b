"""When the serving loop ends: a stop signal, or an operator's `stop`, after an
optional graceful drain.

With ``--graceful-stop-s S`` a SIGTERM/SIGINT does not end the loop at once: the
core closes admission (new submits and routes are refused with
``shutting_down``) and the loop keeps serving what is in flight, until nothing
is left or S seconds passed; then the usual clean shutdown follows and the
process exits 0. An operator's ``graceful_stop`` does the same (for
``DEFAULT_DRAIN_S`` when no S is configured); a plain ``stop`` ends it at once,
as SIGTERM without S does. The core decides what is refused; this only waits.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Final

from coordinator.core.actions import StopProcess
from coordinator.core.events import Event, GracefulStop

log = logging.getLogger("coordinator.server")

DEFAULT_DRAIN_S: Final = 30.0
"""How long an operator's graceful stop waits when ``--graceful-stop-s`` is 0."""
POLL_S: Final = 0.05


class StopControl:
    """Decides when ``CoordinatorServer.serve`` returns."""

    def __init__(self, feed: Callable[[Event], None], in_flight: Callable[[], int],
                 clock: Callable[[], float], *, graceful_stop_s: float) -> None:
        self._feed = feed
        self._in_flight = in_flight
        self._clock = clock
        self.graceful_stop_s = graceful_stop_s
        self._requested: asyncio.Event | None = None
        self._graceful_request = False
        self._request_pending = False

    def request(self, action: StopProcess) -> None:
        """The operator's stop (an action of the core)."""
        self._graceful_request = self._graceful_request or action.graceful
        self._request_pending = True
        if self._requested is not None:
            self._requested.set()

    async def until_stopped(self, stop: asyncio.Event) -> None:
        """Return when the loop should stop serving: at ``stop`` or an operator's stop,
        after the drain when it is graceful."""
        requested = self._requested = asyncio.Event()
        if self._request_pending:
            requested.set()
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(requested.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        by_operator = requested.is_set()
        if by_operator and not self._graceful_request:
            return
        if not by_operator and self.graceful_stop_s <= 0:
            return
        limit = self.graceful_stop_s or DEFAULT_DRAIN_S
        self._feed(GracefulStop("an operator's graceful stop" if by_operator
                                else "a stop signal, with --graceful-stop-s"))
        await self._drain(limit)

    async def _drain(self, limit_s: float) -> None:
        began = self._clock()
        deadline = began + limit_s
        left = self._in_flight()
        while left and self._clock() < deadline:
            await asyncio.sleep(POLL_S)
            left = self._in_flight()
        waited = round(self._clock() - began, 3)
        if left:
            log.warning("graceful stop: %d requests still in flight after %g s; stopping "
                        "anyway (they are failed to their frontends)", left, limit_s,
                        extra={"event": "graceful_stop_ended", "in_flight": left,
                               "waited_s": waited})
        else:
            log.info("graceful stop: nothing in flight after %.3f s; stopping", waited,
                     extra={"event": "graceful_stop_ended", "in_flight": 0,
                            "waited_s": waited})
