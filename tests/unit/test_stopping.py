"""When the serving loop ends: at once, or after a graceful drain bounded by its deadline."""

from __future__ import annotations

import asyncio
import time

from coordinator.core.actions import StopProcess
from coordinator.core.events import Event, GracefulStop
from coordinator.server.stopping import StopControl


class Group:
    """What the control reads and feeds: requests in flight, and the events it sent."""

    def __init__(self, in_flight: int) -> None:
        self.in_flight = in_flight
        self.fed: list[Event] = []

    def control(self, graceful_stop_s: float) -> StopControl:
        return StopControl(self.fed.append, lambda: self.in_flight, time.monotonic,
                           graceful_stop_s=graceful_stop_s)


async def test_a_signal_without_a_graceful_stop_ends_the_loop_at_once() -> None:
    group = Group(in_flight=3)
    stop = asyncio.Event()
    stop.set()
    await asyncio.wait_for(group.control(0).until_stopped(stop), 5)
    assert group.fed == []


async def test_a_signal_with_a_graceful_stop_waits_until_nothing_is_in_flight() -> None:
    group = Group(in_flight=2)
    control, stop = group.control(60), asyncio.Event()
    waiting = asyncio.ensure_future(control.until_stopped(stop))
    stop.set()

    async def fed() -> None:
        while not group.fed:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(fed(), 5)
    assert [type(e) for e in group.fed] == [GracefulStop]
    assert not waiting.done()
    group.in_flight = 0
    await asyncio.wait_for(waiting, 5)


async def test_the_deadline_ends_the_drain() -> None:
    group = Group(in_flight=1)
    stop = asyncio.Event()
    stop.set()
    began = time.monotonic()
    await asyncio.wait_for(group.control(0.3).until_stopped(stop), 5)
    assert time.monotonic() - began >= 0.3


async def test_an_operators_stop_plain_or_graceful() -> None:
    plain = Group(in_flight=1)
    control = plain.control(60)
    control.request(StopProcess(graceful=False))  # before the loop waits: not lost
    await asyncio.wait_for(control.until_stopped(asyncio.Event()), 5)
    assert plain.fed == []

    graceful = Group(in_flight=0)
    control = graceful.control(0)  # no --graceful-stop-s: the operator's default deadline
    waiting = asyncio.ensure_future(control.until_stopped(asyncio.Event()))
    await asyncio.sleep(0)  # let it start waiting
    control.request(StopProcess(graceful=True))
    await asyncio.wait_for(waiting, 5)
    assert [type(e) for e in graceful.fed] == [GracefulStop]
